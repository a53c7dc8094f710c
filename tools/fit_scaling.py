"""Fit scaling laws to your own runs: loss against training compute, L(C) = a C^-b + e (on the
compute frontier of every logged point), and Hoffmann et al.'s L(N, D) = E + A/N^alpha +
B/D^beta (on each run's final loss), both by the Chinchilla paper's robust fit (Huber loss in
log space, L-BFGS from a grid), with bootstrap confidence intervals; print the compute-optimal
parameters and tokens for a budget and draw loss against compute on log-log axes with the
fitted frontier. Compute is the engine's own training FLOP count (as for MFU).

  python tools/fit_scaling.py --runs runs/sweep --target-flops 1e21 --output scaling.png

Each run is a --log-jsonl file with the description the engine writes beside it
(metrics.run.json for metrics.jsonl); a folder is searched for them (examples/scaling_sweep.sh
makes one).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import InputError
from engine.planning.scaling_fit import (
    CHINCHILLA,
    MIN_POINTS,
    bootstrap,
    fit_compute,
    fit_parameter_data,
    frontier,
    interval,
)
from engine.planning.scaling_points import RunPoints, frontier_points, read_runs


def _short(value: float) -> str:
    return f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.3e}"


def _row(name: str, value: float, laws: list, key: str, published: float | None = None) -> str:
    low, high = interval([law.as_dict()[key] for law in laws]) if laws else (np.nan, np.nan)
    line = f"  {name:<7} {_short(value):>11}   [{_short(low)}, {_short(high)}]"
    return line + (f"   Chinchilla {published:g}" if published is not None else "")


def _plot(path: str, runs: list[RunPoints], compute_law, data_law, k: float, target: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    sizes = sorted({r.parameters for r in runs})
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(sizes)))
    for run in runs:
        color = colors[sizes.index(run.parameters)]
        ax.plot(run.compute, run.loss, color=color, alpha=0.35, linewidth=1)
        ax.scatter([run.final_compute], [run.final_loss], color=color, s=30, zorder=3)
    for size, color in zip(sizes, colors, strict=True):
        ax.plot([], [], color=color, marker="o", label=f"N = {size / 1e6:.2f}M")
    low = min(r.compute[0] for r in runs)
    span = np.logspace(np.log10(low), np.log10(target), 100)
    fitted = compute_law.as_dict()
    label = f"L(C) = {_short(fitted['a'])} C^-{fitted['b']:.3f} + {fitted['e']:.2f}"
    ax.plot(span, compute_law.loss(span), "k--", label=label)
    if data_law is not None:
        n, d = data_law.optimal(span, k)
        ax.plot(span, data_law.loss(n, d), "r:", label="L(N_opt, D_opt) from L(N, D)")
    ax.axvline(target, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("loss (lines: training; dots: final, validation where logged)")
    ax.set_title("loss against compute, with the fitted frontier")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = f"{path}.tmp.{os.getpid()}.png"
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", nargs="+", required=True,
                        help="--log-jsonl files of the runs, or folders holding them")  # fmt: skip
    parser.add_argument("--target-flops", type=float, default=None,
                        help="the budget to split (default: 100x the largest run's)")  # fmt: skip
    parser.add_argument("--bootstrap", type=int, default=100,
                        help="resamples for the confidence intervals (0: none)")  # fmt: skip
    parser.add_argument("--skip-first-fraction", type=float, default=0.2,
                        help="each run's first fraction of tokens, left out of L(C)")  # fmt: skip
    parser.add_argument("--output", default=None, help="PNG of loss against compute")
    parser.add_argument("--json", default=None, help="write the fits and intervals here")
    args = parser.parse_args(argv)
    if args.bootstrap < 0:
        raise InputError(f"--bootstrap {args.bootstrap}: give 0 or more resamples")
    if not 0 <= args.skip_first_fraction < 1:
        raise InputError(f"--skip-first-fraction {args.skip_first_fraction}: give 0 to below 1")
    if args.target_flops is not None and args.target_flops <= 0:
        raise InputError(f"--target-flops {args.target_flops}: give a positive budget")
    runs = read_runs(args.runs)
    compute, loss = frontier_points(runs, args.skip_first_fraction)
    kept = frontier(compute, loss)
    if len(kept) < MIN_POINTS:
        raise InputError(
            f"--runs: {len(kept)} points on the compute frontier, a fit needs at least "
            f"{MIN_POINTS}; log more often (--log-interval) or add runs"
        )
    compute_law = fit_compute(compute[kept], loss[kept])
    compute_laws = bootstrap(fit_compute, [compute[kept], loss[kept]], compute_law, args.bootstrap)
    print(f"L(C) = a C^-b + e on {len(kept)} frontier points of {len(runs)} runs "
          "(value, 95% bootstrap interval):")  # fmt: skip
    for key, value in compute_law.as_dict().items():
        print(_row(key, value, compute_laws, key))
    target = args.target_flops or 100 * max(r.final_compute for r in runs)
    k = float(np.median([r.flops_per_token / r.parameters for r in runs]))
    result = {"compute_law": compute_law.as_dict(), "runs": len(runs), "target_flops": target}
    data_law = None
    if len(runs) < MIN_POINTS:
        print(f"L(N, D): {len(runs)} runs, the fit needs at least {MIN_POINTS}; left out")
    else:
        columns = [[r.parameters for r in runs], [r.final_tokens for r in runs],
                   [r.final_loss for r in runs]]  # fmt: skip
        data_law = fit_parameter_data(*columns)
        laws = bootstrap(fit_parameter_data, [np.asarray(c, float) for c in columns], data_law,
                         args.bootstrap)  # fmt: skip
        print(f"L(N, D) = E + A/N^alpha + B/D^beta on the final losses of {len(runs)} runs:")
        for key, value in data_law.as_dict().items():
            print(_row(key, value, laws, key, CHINCHILLA[key]))
        if data_law.undetermined(min(r.final_loss for r in runs)):
            print("warning: these runs leave L(N, D) undetermined (an exponent above 3 or E "
                  "near 0): the larger models are not better at these budgets yet; the split "
                  "below means nothing until runs with more tokens per parameter come")  # fmt: skip
        n, d = data_law.optimal(target, k)
        spread = [law.optimal(target, k) for law in laws]
        print(f"compute-optimal for {target:.3g} FLOPs (C = {k:.2f} N D): "
              f"N = {_short(n)} {_interval(x for x, _ in spread)}, "
              f"D = {_short(d)} tokens {_interval(y for _, y in spread)}")  # fmt: skip
        result |= {"data_law": data_law.as_dict(), "optimal_parameters": n, "optimal_tokens": d}
    if args.output:
        _plot(args.output, runs, compute_law, data_law, k, target)
        print(f"wrote {args.output}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _interval(values) -> str:
    values = list(values)
    if not values:
        return ""
    low, high = interval(values)
    return f"[{_short(low)}, {_short(high)}]"


if __name__ == "__main__":
    run_main(main)
