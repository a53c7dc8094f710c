"""Draw a one-page dashboard PNG of one or more runs from their --log-jsonl files: the loss
(training, each evaluation split, and each dataset of a blend), the learning rate, the gradient
norm, the gradient norm of each layer as a heat map (--log-grad-norms-interval), tokens/s and
MFU, the time breakdown of the steps as stacked bars, memory, and the loss variance and gradient
noise scale; for a mixture of experts also each MoE layer's expert load as a heat map (the last
logged step) and the load imbalance over the run; with --log-gradient-cosine-interval the
gradient cosine of each pair of a blend's datasets over training (whole model, and by layer
group as a heat map) beside what its sign means; with --log-update-to-weight-ratios and
--log-activation-stats each layer group's update over its weights and each layer's output RMS
and largest magnitude; and the valid - train loss gap beside the learning rate. Several files
are overlaid, one colour per run (the heat maps and the time breakdown show the first); runs
that differ only in --seed (by the configuration each writes beside its log) share a colour,
their loss drawn as mean +- standard deviation over the seeds and their final losses printed
as such:

  python tools/plot_metrics.py --log-jsonl a/metrics.jsonl b/metrics.jsonl --output runs.png
"""

from __future__ import annotations

import argparse
import os
import re

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.monitor.run_log import read_log
from engine.monitor.seed_groups import SeedGroup, final_text, group_by_seed, mean_and_std

_LAYER = re.compile(r"^grad_norm/layers\.(\d+)$")


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
    return ([x for x, _ in points], [y for _, y in points]) if points else ([], [])


def _label(path: str, paths: list[str]) -> str:
    """The file name, or its folder's when the runs' file names are the same."""
    names = [os.path.basename(p) for p in paths]
    if names.count(os.path.basename(path)) > 1:
        return os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return os.path.basename(path)


def _draw_run(
    axes: dict, train: list[dict], evals: list[dict], label: str, color, loss: bool = True
) -> None:
    """Every panel's line of one run (the loss's unless `loss` is False: a seed band's)."""
    if loss:
        axes["loss"].plot(*_series(train, "lm_loss"), color=color, linewidth=1.5, label=label)
    for marker, split in zip("os^", sorted({r["split"] for r in evals}), strict=False):
        found = [r for r in evals if r["split"] == split]
        if loss:
            axes["loss"].plot(
                *_series(found, "lm_loss"), marker + "--", color=color, label=f"{label} {split}"
            )
    domains = sorted({k for r in train for k in r if k.startswith("lm_loss/")})
    for style, key in zip(("--", ":", "-.") * 8, domains, strict=False):
        name = key.removeprefix("lm_loss/")
        axes["loss"].plot(
            *_series(train, key), style, color=color, alpha=0.7, label=f"{label} {name}"
        )
    axes["lr"].plot(*_series(train, "lr"), color=color, label=label)
    gap = _series([r for r in evals if r["split"] == "valid"], "train_valid_gap")
    if gap[0]:
        axes["gap"].plot(*gap, "s:", color=color, alpha=0.7, label=f"{label} valid - train")
    axes["grad"].plot(*_series(train, "grad_norm"), color=color, label=label)
    axes["speed"].plot(*_series(train, "tokens_per_sec"), color=color, label=f"{label} tokens/s")
    mfu = _series(train, "mfu")
    if mfu[0]:
        axes["mfu"].plot(mfu[0], [100 * v for v in mfu[1]], ":", color=color, label=f"{label} MFU")
    axes["memory"].plot(*_series(train, "mem_gb"), color=color, label=label)
    if "imbalance" in axes:
        axes["imbalance"].plot(*_series(train, "moe_load_imbalance"), color=color, label=label)
    if "slowest" in axes:
        axes["slowest"].plot(*_series(train, "own_time_max_over_median"), color=color, label=label)
    axes["noise"].plot(*_series(train, "lm_loss_var"), color=color, label=f"{label} loss variance")
    scale = _series(train, "gradient_noise_scale")
    if scale[0]:
        axes["noise_scale"].plot(*scale, ":", color=color, label=f"{label} noise scale")


def _draw_seed_band(ax, group: SeedGroup, logs: dict, label: str, color) -> None:
    """The loss's mean +- standard deviation over a group's seeds (training: a band;
    evaluations: error bars), and its final values printed."""
    train = [_series(logs[p][0], "lm_loss") for p in group.paths]
    x, mean, std = mean_and_std(train)
    seeds = ", ".join(str(s) for s in group.seeds)
    ax.plot(x, mean, color=color, linewidth=1.5, label=f"{label} (seeds {seeds}): mean +- std")
    low = [m - s for m, s in zip(mean, std, strict=True)]
    high = [m + s for m, s in zip(mean, std, strict=True)]
    ax.fill_between(x, low, high, color=color, alpha=0.25)
    print(f"{label}: final lm loss over seeds {seeds}: "
          f"{final_text([logs[p][0][-1].get('lm_loss') for p in group.paths])}")  # fmt: skip
    splits = sorted({r["split"] for p in group.paths for r in logs[p][1]})
    for marker, split in zip("os^", splits, strict=False):
        series = [_series([r for r in logs[p][1] if r["split"] == split], "lm_loss")
                  for p in group.paths]  # fmt: skip
        if not all(xs for xs, _ in series):
            continue
        ex, em, es = mean_and_std(series)
        ax.errorbar(ex, em, yerr=es, fmt=marker + "--", color=color, capsize=3,
                    label=f"{label} {split} mean +- std")  # fmt: skip
        print(f"{label}: final {split} lm loss over seeds {seeds}: "
              f"{final_text([y[-1] for _, y in series])}")  # fmt: skip


def _draw_time_breakdown(ax, train: list[dict], label: str) -> None:
    """Seconds per iteration in each part of the steps, stacked, beside the wall time."""
    parts = sorted({k for r in train for k in r if k.startswith("time/")})
    if not parts:
        ax.text(0.5, 0.5, "no time breakdown in this log", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
        return
    import matplotlib

    iterations = [r["iteration"] for r in train]
    width = 0.8 * min((b - a for a, b in zip(iterations, iterations[1:], strict=False)), default=1)
    bottom = [0.0] * len(train)
    colors = matplotlib.colormaps["tab20"].colors
    for k, part in enumerate(parts):
        values = [r.get(part, 0.0) for r in train]
        ax.bar(
            iterations, values, width, bottom=bottom, color=colors[k % len(colors)],
            label=part.removeprefix("time/"),
        )  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, values, strict=False)]
    wall = _series(train, "iteration_time_s")
    ax.plot(*wall, "k.-", linewidth=1, label="wall time")
    ax.set_ylim(0, 1.7 * max(bottom + wall[1]))  # room for the legend above the bars
    ax.legend(fontsize=6, ncol=4, loc="upper center")
    ax.set_title(f"time per iteration by part ({label})")


def _draw_layer_heat_map(ax, train: list[dict], label: str) -> None:
    """Each layer's gradient norm (rows) over the iterations that logged one (columns)."""
    rows = sorted({int(m.group(1)) for r in train for k in r if (m := _LAYER.match(k))})
    logged = [r for r in train if any(_LAYER.match(k) for k in r)]
    if not rows:
        ax.text(0.5, 0.5, "no per-layer gradient norms\n(--log-grad-norms-interval N)",
                ha="center", va="center", transform=ax.transAxes)  # fmt: skip
        ax.set_axis_off()
        return
    values = [[r.get(f"grad_norm/layers.{i}", float("nan")) for r in logged] for i in rows]
    iterations = [r["iteration"] for r in logged]
    image = ax.imshow(
        values,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        extent=(iterations[0] - 0.5, iterations[-1] + 0.5, rows[0] - 0.5, rows[-1] + 0.5),
    )
    ax.figure.colorbar(image, ax=ax, label="grad norm")
    ax.set_yticks(rows)
    ax.set_ylabel("layer")
    ax.set_title(f"gradient norm per layer ({label})")


def _draw_expert_load(ax, train: list[dict], label: str) -> None:
    """Each MoE layer's tokens per expert over the mean (rows: layers, columns: experts), as
    the last record that logged them holds them."""
    last = next(r["moe_expert_load"] for r in reversed(train) if r.get("moe_expert_load"))
    layers = sorted(last, key=int)
    values = [last[layer] for layer in layers]
    image = ax.imshow(values, aspect="auto", origin="lower", interpolation="nearest", cmap="magma")
    ax.figure.colorbar(image, ax=ax, label="tokens / mean")
    ax.set_yticks(range(len(layers)), layers)
    ax.set_ylabel("MoE layer")
    ax.set_xlabel("expert")
    iteration = next(r["iteration"] for r in reversed(train) if r.get("moe_expert_load"))
    ax.set_title(f"expert load at iteration {iteration} ({label})")


def _draw_rank_times(ax, train: list[dict], label: str) -> None:
    """Each rank's own compute seconds per iteration at each log line (--log-straggler):
    rows are ranks, so a straggler is a bright row."""
    logged = [r for r in train if r.get("own_time_per_rank")]
    values = list(zip(*(r["own_time_per_rank"] for r in logged), strict=True))
    image = ax.imshow(values, aspect="auto", origin="lower", interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, label="s / iteration")
    ticks = range(0, len(logged), max(1, len(logged) // 6))
    ax.set_xticks(list(ticks), [str(logged[k]["iteration"]) for k in ticks])
    ax.set_yticks(list(range(0, len(values), max(1, len(values) // 16))))
    ax.set_xlabel("iteration")
    ax.set_ylabel("rank")
    ax.set_title(f"own compute per rank, waits left out ({label})")


MEANINGS = "cosine > 0: transfer | ~ 0: neutral | < 0: interference"


def _draw_interference(ax, heat, train: list[dict], label: str) -> None:
    """--log-gradient-cosine-interval: each pair of datasets' gradient cosine over training
    (whole model), with the meanings of its sign; beside it the first pair's cosine in each
    layer group over training (rows: groups)."""
    pairs = sorted({k for r in train for k in r if k.startswith("grad_cosine/") and
                    k.count("/") == 1})  # fmt: skip
    for key in pairs:
        ax.plot(*_series(train, key), marker=".", label=key.removeprefix("grad_cosine/"))
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.axhspan(0, 1, color="tab:green", alpha=0.06)
    ax.axhspan(-1, 0, color="tab:red", alpha=0.06)
    ax.text(0.01, 0.02, MEANINGS, transform=ax.transAxes, fontsize=7)
    ax.set_ylim(-1.05, 1.05)
    ax.set_title(f"gradient cosine between datasets ({label})")
    ax.set_xlabel("iteration")
    ax.legend(fontsize=7)
    first = pairs[0] + "/"
    groups = [k for k in train[-1] if k.startswith(first)] or sorted(
        {k for r in train for k in r if k.startswith(first)}
    )
    logged = [r for r in train if pairs[0] in r]
    values = [[r.get(g, float("nan")) for r in logged] for g in groups]
    image = heat.imshow(values, aspect="auto", origin="lower", interpolation="nearest",
                        cmap="RdBu", vmin=-1, vmax=1)  # fmt: skip
    heat.figure.colorbar(image, ax=heat, label="cosine")
    heat.set_yticks(range(len(groups)), [g.removeprefix(first) for g in groups], fontsize=6)
    ticks = range(0, len(logged), max(1, len(logged) // 6))
    heat.set_xticks(list(ticks), [str(logged[k]["iteration"]) for k in ticks])
    heat.set_xlabel("iteration")
    heat.set_title(f"{pairs[0].removeprefix('grad_cosine/')} by layer group ({label})")


def _draw_health(ratios_ax, activations_ax, train: list[dict], label: str) -> None:
    """--log-update-to-weight-ratios (each layer group's |update| / |weight|) and
    --log-activation-stats (each layer's output RMS, solid, and largest magnitude, dashed)."""
    keys = sorted({k for r in train for k in r if k.startswith("update_ratio/")})
    for key in keys:
        ratios_ax.plot(*_series(train, key), label=key.removeprefix("update_ratio/"))
    ratios_ax.set_title(f"update / weight norm by layer group ({label})")
    layers = sorted({k.removeprefix("act_rms/") for r in train for k in r
                     if k.startswith("act_rms/")}, key=lambda n: int(n.split(".")[-1]))  # fmt: skip
    for n, layer in enumerate(layers):
        line = activations_ax.plot(*_series(train, f"act_rms/{layer}"), label=f"{layer} rms")
        activations_ax.plot(*_series(train, f"act_max/{layer}"), "--",
                            color=line[0].get_color(), alpha=0.6)  # fmt: skip
        if n >= 15:
            break
    activations_ax.set_title(f"layer outputs: RMS (solid), max |x| (dashed) ({label})")
    for ax in (ratios_ax, activations_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.set_yscale("log")
            ax.legend(fontsize=6, ncol=2)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-jsonl", nargs="+", required=True, help="metrics of one or more runs")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    runs = [(path, *read_log(path)) for path in args.log_jsonl]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = any(r.get("moe_expert_load") for r in runs[0][1])
    stragglers = any(r.get("own_time_per_rank") for r in runs[0][1])
    interference = any(k.startswith("grad_cosine/") for r in runs[0][1] for k in r)
    health = any(k.startswith(("update_ratio/", "act_rms/")) for r in runs[0][1] for k in r)
    rows = 4 + moe + stragglers + interference + health
    fig, grid = plt.subplots(rows, 2, figsize=(13, 3.5 * rows))
    axes = {
        "loss": grid[0, 0], "lr": grid[0, 1], "grad": grid[1, 0], "layers": grid[1, 1],
        "speed": grid[2, 0], "time": grid[2, 1], "memory": grid[3, 0], "noise": grid[3, 1],
    }  # fmt: skip
    if moe:
        axes["imbalance"] = grid[4, 1]
        _draw_expert_load(grid[4, 0], runs[0][1], _label(runs[0][0], args.log_jsonl))
    if interference:
        row = 4 + moe
        _draw_interference(grid[row, 0], grid[row, 1], runs[0][1],
                           _label(runs[0][0], args.log_jsonl))  # fmt: skip
    if health:
        row = 4 + moe + interference
        _draw_health(grid[row, 0], grid[row, 1], runs[0][1], _label(runs[0][0], args.log_jsonl))
    if stragglers:
        axes["slowest"] = grid[rows - 1, 1]
        _draw_rank_times(grid[rows - 1, 0], runs[0][1], _label(runs[0][0], args.log_jsonl))
    axes["mfu"] = axes["speed"].twinx()
    axes["noise_scale"] = axes["noise"].twinx()
    axes["gap"] = axes["lr"].twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    logs = {path: (train, evals) for path, train, evals in runs}
    for k, group in enumerate(group_by_seed(args.log_jsonl)):
        color, banded = colors[k % len(colors)], len(group.paths) > 1
        for path in group.paths:
            _draw_run(axes, *logs[path], _label(path, args.log_jsonl), color, loss=not banded)
        if banded:
            _draw_seed_band(
                axes["loss"], group, logs, _label(group.paths[0], args.log_jsonl), color
            )
    _draw_layer_heat_map(axes["layers"], runs[0][1], _label(runs[0][0], args.log_jsonl))
    _draw_time_breakdown(axes["time"], runs[0][1], _label(runs[0][0], args.log_jsonl))
    titles = {
        "loss": ("lm loss", "loss: train (lines), evaluations (markers), datasets (dashed)"),
        "lr": ("learning rate", "learning rate (and the valid - train loss gap)"),
        "grad": ("grad norm", "gradient norm"),
        "speed": ("tokens/s", "throughput"),
        "time": ("seconds", None),
        "memory": ("GB", "memory (the rank that logs)"),
        "noise": ("loss variance", "loss variance over the window, gradient noise scale"),
    }
    if "imbalance" in axes:
        titles["imbalance"] = ("max / mean", "expert load imbalance (the busiest expert)")
    if "slowest" in axes:
        titles["slowest"] = ("max / median", "the slowest rank's own compute over the median")
    for name, (ylabel, title) in titles.items():
        axes[name].set_ylabel(ylabel)
        if title:
            axes[name].set_title(title)
        axes[name].set_xlabel("iteration")
        axes[name].grid(alpha=0.3)
        if axes[name].get_legend_handles_labels()[0] and not axes[name].get_legend():
            axes[name].legend(fontsize=7)
    twins = (("mfu", "MFU (%)"), ("noise_scale", "gradient noise scale"),
             ("gap", "valid - train loss"))  # fmt: skip
    for twin, ylabel in twins:
        if axes[twin].get_legend_handles_labels()[0]:
            axes[twin].set_ylabel(ylabel)
            axes[twin].legend(fontsize=7, loc="lower right")
        else:
            axes[twin].set_axis_off()
    fig.suptitle(args.title or ", ".join(_label(p, args.log_jsonl) for p in args.log_jsonl))
    fig.tight_layout()
    tmp = f"{args.output}.tmp.{os.getpid()}.png"
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run(main)
