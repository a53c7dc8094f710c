"""A training budget from any two of: parameters, tokens, FLOPs, (cluster and days).

    python tools/compute_budget.py --parameters 7B --tokens 2T --gpu h100 --gpus 256
    python tools/compute_budget.py --flops 5.76e23                 # its compute-optimal split
    python tools/compute_budget.py --parameters 1B --gpu h100 --gpus 64 --days 3

Prints the budget (C = 6 N D), its tokens per parameter beside published runs', the
compute-optimal split of the same FLOPs (20 tokens per parameter, and Hoffmann et al.'s
fitted law, engine/planning/budget.py), and, with a cluster, the days and GPU hours at
--mfu of the datasheet peak (--gpu names a row of engine/monitor/metrics.py's table), or at the MFU
tools/plan.py predicts for the best layout of a model (--plan, its --json file):

    python tools/plan.py --gpu h100 --gpus 256 <model flags> --json plan.json
    python tools/compute_budget.py --parameters 7B --tokens 2T --plan plan.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import ConfigError
from engine.planning.budget import PUBLISHED_RUNS, Cluster, parse_amount, solve


def _planned_cluster(path: str) -> tuple[Cluster, str]:
    """The cluster and rate of the best fitting row of tools/plan.py --json's file."""
    try:
        with open(path) as f:
            rows = json.load(f)
        best = next(r for r in rows if r["fits"])
        layout, prediction = best["layout"], best["prediction"]
        gpus = layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"]
        tflops, mfu, name = prediction["tflops"], prediction["mfu"], best["machine"]
    except OSError as err:
        raise ConfigError(f"--plan {path}: cannot be read ({err.strerror})") from None
    except StopIteration:
        raise ConfigError(f"--plan {path}: no layout in it fits in memory; plan again") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"--plan {path}: not a file of tools/plan.py --json; write one with it"
        ) from None
    if not mfu or tflops <= 0:
        raise ConfigError(f"--plan {path}: planned for {name}, which has no datasheet peak")
    return Cluster(gpus, tflops / mfu, mfu), name


def _cluster(args):
    from engine.monitor.metrics import PEAK_TFLOPS

    if args.plan is not None:
        if args.gpu or args.gpus or args.mfu_given:
            raise ConfigError("--plan gives the cluster and its MFU; drop --gpu, --gpus, --mfu")
        cluster, args.gpu = _planned_cluster(args.plan)
        return cluster
    if args.gpu is None and args.gpus is None:
        return None
    if args.gpu is None or args.gpus is None:
        raise ConfigError("a cluster needs both --gpu and --gpus")
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: give at least 1")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu}: give a share of the peak in (0, 1]")
    names = sorted({name for name, kind in PEAK_TFLOPS if kind == args.dtype})
    match = [n for n in names if n.lower() == args.gpu.lower()]
    if not match:
        raise ConfigError(
            f"--gpu {args.gpu}: no {args.dtype} peak known; one of: {', '.join(names)}"
        )
    return Cluster(args.gpus, PEAK_TFLOPS[(match[0], args.dtype)], args.mfu)


def _short(value: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parameters", help="N, e.g. 7B")
    parser.add_argument("--tokens", help="D, e.g. 2T")
    parser.add_argument("--flops", help="C, e.g. 5.76e23")
    parser.add_argument("--days", type=float, help="wall-clock days on the cluster")
    parser.add_argument("--gpu", help="e.g. H100, H200, A100")
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--mfu", type=float, help="share of the peak reached (default 0.4)")
    parser.add_argument(
        "--plan", help="the cluster and MFU of the best layout in tools/plan.py --json's file"
    )
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.mfu_given = args.mfu is not None
    args.mfu = 0.4 if args.mfu is None else args.mfu
    amounts = {
        name: parse_amount(f"--{name}", getattr(args, name)) if getattr(args, name) else None
        for name in ("parameters", "tokens", "flops")
    }
    if args.days is not None and not 0 < args.days < math.inf:
        raise ConfigError(f"--days {args.days}: must be a finite number more than 0")
    report = None
    if args.json:
        try:
            report = open(args.json, "w")  # noqa: SIM115 (closed below; opened early to fail early)
        except OSError as err:
            raise ConfigError(f"--json {args.json}: cannot write it ({err.strerror})") from None
    cluster = _cluster(args)
    out = solve(**amounts, cluster=cluster, days=args.days)
    print(f"parameters N       {_short(out['parameters'])}")
    print(f"tokens D           {_short(out['tokens'])}")
    print(f"FLOPs C = 6ND      {out['flops']:.3e}")
    print(f"tokens/parameter   {out['tokens_per_parameter']:.1f}")
    print(f"fitted loss        {out['loss_fitted']:.3f} (Hoffmann et al. 2022, eq. 10)")
    n20, d20 = out["optimal_20x"]
    nfit, dfit = out["optimal_fitted"]
    print("compute-optimal for the same FLOPs:")
    print(f"  20 tokens/param  N {_short(n20)}, D {_short(d20)}")
    print(f"  fitted law       N {_short(nfit)}, D {_short(dfit)} "
          f"(loss {out['loss_fitted_optimal']:.3f})")  # fmt: skip
    if cluster is not None:
        source = " (tools/plan.py's best layout)" if args.plan else ""
        print(f"on {cluster.gpus} x {args.gpu} at {cluster.mfu:.1%} MFU{source} "
              f"({cluster.peak_tflops:g} TFLOP/s {args.dtype} peak): {out['days']:.2f} days, "
              f"{out['gpu_hours']:,.0f} GPU hours")  # fmt: skip
    print("published runs (tokens/parameter):")
    for name, n, d in PUBLISHED_RUNS:
        print(f"  {name:<15} N {_short(n):>6}  D {_short(d):>6}  {d / n:>7.1f}")
    if report is not None:
        with report:
            json.dump(out, report, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
