"""Weak and strong scaling of the engine, measured for real, with the planner's prediction beside
every row.

Weak scaling keeps each rank's work fixed (--micro-batch-size x --microbatches samples per data-
parallel rank, the global batch growing with the world); strong scaling keeps the global batch
fixed (--global-batch-size) and splits it over more ranks. The world grows along --grow: data
parallel (default), tensor parallel (with sequence parallelism) or pipeline stages.

Sizes in --world-sizes are run: on this machine each on local gloo ranks (one core each,
engine/planning/measure.py: the engine set up from the layout's flags, random tokens, the
slowest rank's median step); launched by torchrun (or srun around it) with --world-sizes equal
to the world, that world is measured on its devices (NCCL on GPUs). Sizes in --predict-sizes are
predicted only (tools/plan.py's model, calibrated by --calibration or measured now). Prints a
table (aggregate and per-rank tokens/s, TFLOP/s per rank, MFU where the peak is known, efficiency
against the smallest run, predicted tokens/s), writes JSON and a PNG in the style of
Megatron-LM's scaling figures: aggregate throughput against the world, perfect linear scaling
from the smallest run, measured points solid, predicted dashed.
"""

from __future__ import annotations

import json
import os

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import ConfigError
from engine.planning.memory import Layout


def _model_flags(args) -> list[str]:
    from engine.planning.measure import mock_gpt_flags

    return mock_gpt_flags(args.num_layers, args.hidden_size, args.seq_length, args.vocab_size)


def scaling_layout(mode: str, grow: str, world: int, args) -> Layout:
    """The layout of `world` ranks: the world along `grow`, the batch by `mode`."""
    sizes = {"tp": 1, "pp": 1, "dp": 1, grow: world}
    mbs = args.micro_batch_size
    if mode == "weak":
        per_replica = mbs * args.microbatches
    else:
        if args.global_batch_size % (sizes["dp"] * mbs):
            raise ConfigError(
                f"--global-batch-size {args.global_batch_size} does not split into micro-batches "
                f"of {mbs} over {sizes['dp']} data-parallel ranks; use a multiple of "
                f"{sizes['dp'] * mbs}"
            )
        per_replica = args.global_batch_size // sizes["dp"]
    return Layout(
        tp=sizes["tp"], pp=sizes["pp"], dp=sizes["dp"], sequence_parallel=sizes["tp"] > 1,
        micro_batch_size=mbs, num_microbatches=per_replica // mbs,
        overlap_grad_reduce=sizes["dp"] > 1,
    )  # fmt: skip


def _measure(flags: list[str], world: int, args) -> float:
    from engine.planning.measure import measure_rank

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun: this world
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(
                f"--world-sizes {world}: under torchrun give the launched world, "
                f"{os.environ['WORLD_SIZE']}"
            )
        from parallel.state import init_distributed

        rank, _, _ = init_distributed()  # nccl and this rank's GPU where there are GPUs
        return measure_rank(rank, world, flags, args.warmup, args.steps)["step_s"]
    from parallel.local_ranks import run_local

    return run_local(measure_rank, world, flags, args.warmup, args.steps, threads=1, timeout=3600)[
        0
    ]["step_s"]


def rows_for(mode: str, args, machine) -> list[dict]:
    from engine.monitor.metrics import model_flops_per_token
    from engine.planning.flags import layout_flags
    from engine.planning.step_time import predict_step
    from engine.pretrain import parse

    model = _model_flags(args)
    cfg = parse(model + ["--micro-batch-size", "1"]).model
    rows = []
    for world in sorted(set(args.world_sizes) | set(args.predict_sizes)):
        layout = scaling_layout(mode, args.grow, world, args)
        flops = model_flops_per_token(cfg, cfg.padded_vocab_size(layout.tp))
        tokens = cfg.seq_length * layout.micro_batch_size * layout.num_microbatches * layout.dp
        predicted = predict_step(cfg, layout, machine)["step_s"]
        row = {
            "mode": mode, "world": world, "flags": " ".join(layout_flags(cfg, layout)),
            "tokens_per_step": tokens, "predicted_tokens_per_s": tokens / predicted,
            "measured": world in args.world_sizes,
        }  # fmt: skip
        if row["measured"]:
            step = _measure(model + layout_flags(cfg, layout), world, args)
            row["tokens_per_s"] = tokens / step
            row["tflops_per_rank"] = tokens * flops / step / world / 1e12
            if machine.peak_flops:
                row["mfu"] = row["tflops_per_rank"] * 1e12 / machine.peak_flops
        rows.append(row)
    base = next((r for r in rows if r["measured"]), rows[0])
    key = "tokens_per_s" if base["measured"] else "predicted_tokens_per_s"
    for row in rows:
        value = row.get("tokens_per_s", row["predicted_tokens_per_s"])
        row["efficiency"] = value / (base[key] * row["world"] / base["world"])  # against linear
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, mode in zip(axes, ("weak", "strong"), strict=False):
        part = [r for r in rows if r["mode"] == mode]
        if not part:
            ax.set_visible(False)
            continue
        worlds = [r["world"] for r in part]
        base = part[0].get("tokens_per_s", part[0]["predicted_tokens_per_s"])
        ax.plot(worlds, [base * w / worlds[0] for w in worlds], ":", color="gray",
                label="perfect linear scaling")  # fmt: skip
        ax.plot(worlds, [r["predicted_tokens_per_s"] for r in part], "--", color="tab:blue",
                label="predicted (tools/plan.py)")  # fmt: skip
        measured = [r for r in part if r["measured"]]
        ax.plot([r["world"] for r in measured], [r["tokens_per_s"] for r in measured], "o-",
                color="tab:green", label="measured")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"{mode} scaling")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from engine.planning.calibrate import calibrate_cpu
    from engine.planning.hardware import datasheet_machine, load_machine

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["weak", "strong", "both"], default="both")
    parser.add_argument("--grow", choices=["dp", "tp", "pp"], default="dp")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], help="measured")
    parser.add_argument("--predict-sizes", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--calibration", help="tools/plan.py --calibrate's file (else measured)")
    parser.add_argument("--gpu", help="plan for this datasheet GPU (runs on GPUs)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2, help="per rank, weak scaling")
    parser.add_argument("--global-batch-size", type=int, default=32, help="strong scaling")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="bench_scaling.json")
    parser.add_argument("--png", default="bench_scaling.png")
    args = parser.parse_args(argv)
    for flag in ("world_sizes", "predict_sizes"):
        if any(w < 1 for w in getattr(args, flag)):
            raise ConfigError(f"--{flag.replace('_', '-')}: every size must be at least 1")
    modes = ("weak", "strong") if args.mode == "both" else (args.mode,)
    for mode in modes:  # every size's layout checked before anything runs
        for world in set(args.world_sizes) | set(args.predict_sizes):
            scaling_layout(mode, args.grow, world, args)
    if args.gpu:
        machine = datasheet_machine(args.gpu)
    elif args.calibration:
        machine = load_machine(args.calibration)
    else:
        machine = calibrate_cpu()
    rows = [row for mode in modes for row in rows_for(mode, args, machine)]
    print(f"machine: {machine.name}; the world grows along {args.grow}")
    header = (f"{'mode':6s} {'ranks':>5s} {'tokens/s':>10s} {'per rank':>9s} {'TFLOP/s/rank':>12s} "
              f"{'MFU':>6s} {'efficiency':>10s} {'predicted':>10s}")  # fmt: skip
    print(header)
    for r in rows:
        measured = r["measured"]
        cells = (
            f"{r['tokens_per_s']:10.0f} {r['tokens_per_s'] / r['world']:9.0f} "
            f"{r['tflops_per_rank']:12.4f}"
            if measured
            else f"{'-':>10s} {'-':>9s} {'-':>12s}"
        )
        mfu = f"{r['mfu']:6.1%}" if "mfu" in r else f"{'-':>6s}"
        note = "" if measured else "  (predicted)"
        print(f"{r['mode']:6s} {r['world']:5d} {cells} {mfu} {r['efficiency']:10.1%} "
              f"{r['predicted_tokens_per_s']:10.0f}{note}")  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"machine": machine.name, "grow": args.grow, "rows": rows}, f, indent=1)
    plot(rows, args.png)
    print(f"wrote {args.json} and {args.png}")
    return 0


if __name__ == "__main__":
    run_main(main)
