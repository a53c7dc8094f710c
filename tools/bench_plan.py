"""How right the planner is on this machine: predicted against measured step time for layouts
on 1 and 2 gloo ranks (one core each), after calibrating (tools/plan.py --calibrate, or
--calibration FILE); and Megatron-LM's published H100 results against the model calibrated on
one of them (engine/planning/published.py).

Each layout runs the engine for real (engine/planning/measure.py: the engine set up from the
layout's flags, random tokens, --warmup then --steps steps, the slowest rank's median). The
model: GPT-2 style, fp32 (the CPU's dtype), --num-layers x --hidden-size, sequence
--seq-length, and the same with its MLPs a mixture of experts (expert parallelism and its
all-to-all). Prints both tables with their median errors and writes JSON.
"""

from __future__ import annotations

import json
import statistics

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import ConfigError
from engine.planning.memory import Layout

# (name, Layout, recomputation): every parallel dimension, schedule, sharding strategy and
# recomputation the planner chooses among, on at most 2 ranks
CPU_LAYOUTS = (
    ("1 rank, mbs 1 x 4", Layout(num_microbatches=4), "none"),
    ("1 rank, mbs 4 x 1", Layout(micro_batch_size=4), "none"),
    ("1 rank, full recompute", Layout(micro_batch_size=2, num_microbatches=2), "full"),
    ("1 rank, selective", Layout(micro_batch_size=2, num_microbatches=2), "selective"),
    ("TP2", Layout(tp=2, micro_batch_size=2, num_microbatches=2), "none"),
    ("TP2 SP", Layout(tp=2, sequence_parallel=True, micro_batch_size=2,
                      num_microbatches=2), "none"),
    ("PP2 1F1B m4", Layout(pp=2, num_microbatches=4), "none"),
    ("PP2 interleaved v2 m4", Layout(pp=2, virtual=2, num_microbatches=4), "none"),
    ("PP2 GPipe m4", Layout(pp=2, num_microbatches=4, schedule="gpipe"), "none"),
    ("DP2", Layout(dp=2, micro_batch_size=2, num_microbatches=1, overlap_grad_reduce=True), "none"),
    ("DP2 dist-opt", Layout(dp=2, strategy="optim", micro_batch_size=2, num_microbatches=1,
                            overlap_grad_reduce=True, overlap_param_gather=True), "none"),
    ("DP2 FSDP", Layout(dp=2, strategy="optim_grads_params", micro_batch_size=2,
                        num_microbatches=1, overlap_grad_reduce=True), "none"),
    ("CP2", Layout(cp=2, micro_batch_size=2, num_microbatches=2), "none"),
)  # fmt: skip
# the same model with every MLP a mixture of 4 experts, top-2, all-to-all dispatch (GPT-2 style
# biases: the experts whole on each rank, ETP 1)
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
             "alltoall"]  # fmt: skip
MOE_LAYOUTS = (
    ("MoE 1 rank, mbs 2 x 2", Layout(micro_batch_size=2, num_microbatches=2), "none"),
    ("MoE DP2 EP2", Layout(dp=2, ep=2, micro_batch_size=2, num_microbatches=1,
                           overlap_grad_reduce=True), "none"),
    ("MoE TP2 SP EP2 ETP1", Layout(tp=2, sequence_parallel=True, ep=2, etp=1,
                                   micro_batch_size=2, num_microbatches=2), "none"),
)  # fmt: skip


def _model_flags(args) -> list[str]:
    from engine.planning.measure import mock_gpt_flags

    return mock_gpt_flags(args.num_layers, args.hidden_size, args.seq_length, args.vocab_size)


def layout_cases(args) -> list[tuple[tuple, list[str]]]:
    """((name, Layout, recomputation), the model's flags) of every layout measured."""
    dense = _model_flags(args)
    return [(case, dense) for case in CPU_LAYOUTS] + [
        (case, dense + MOE_FLAGS) for case in MOE_LAYOUTS
    ]


def cpu_rows(args, machine) -> list[dict]:
    from engine.planning.flags import layout_flags
    from engine.planning.measure import measure_rank
    from engine.planning.search import with_recompute
    from engine.planning.step_time import predict_step
    from engine.pretrain import parse
    from parallel.local_ranks import run_local

    rows = []
    for (name, layout, recompute), model in layout_cases(args):
        if args.only and name not in args.only:
            continue
        cfg = with_recompute(parse(model + ["--micro-batch-size", "1"]).model, recompute)
        flags = model + layout_flags(cfg, layout)
        measured = run_local(
            measure_rank, layout.world, flags, args.warmup, args.steps, threads=1, timeout=1800
        )[0]["step_s"]
        predicted = predict_step(cfg, layout, machine)["step_s"]
        rows.append(
            {
                "layout": name,
                "flags": " ".join(layout_flags(cfg, layout)),
                "measured_s": measured,
                "predicted_s": predicted,
                "error": abs(predicted - measured) / measured,
            }
        )
        print(f"  {name:28s} measured {measured:.3f} s  predicted {predicted:.3f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from engine.planning import published
    from engine.planning.calibrate import calibrate_cpu
    from engine.planning.hardware import load_machine

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--calibration", help="a file from tools/plan.py --calibrate")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-cpu", action="store_true", help="the published table only")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="measure only these layouts (by their names)"
    )
    parser.add_argument("--json", default="bench_plan.json")
    args = parser.parse_args(argv)
    names = [case[0] for case, _ in layout_cases(args)]
    unknown = [name for name in args.only or [] if name not in names]
    if unknown:
        raise ConfigError(f"--only {unknown[0]!r}: no such layout; choose among {names}")
    out = {}
    if not args.skip_cpu:
        machine = load_machine(args.calibration) if args.calibration else calibrate_cpu()
        print(f"machine: {machine.name}")
        rows = cpu_rows(args, machine)
        out["cpu"] = {"rows": rows, "median_error": statistics.median(r["error"] for r in rows)}
        print(f"\n{'layout':28s} {'measured s':>10s} {'predicted s':>11s} {'error':>6s}")
        for r in rows:
            print(
                f"{r['layout']:28s} {r['measured_s']:10.3f} {r['predicted_s']:11.3f} "
                f"{r['error']:6.1%}"
            )
        print(f"median error {out['cpu']['median_error']:.1%} over {len(rows)} layouts\n")
    efficiency, table = published.rows()
    error = published.median_error(table)
    out["published"] = {"gemm_efficiency": efficiency, "rows": table, "median_error": error}
    print(f"Megatron-LM H100 results; GEMM efficiency {efficiency:.3f} fitted on its 1.7B row")
    print(f"{'run':20s} {'GPUs':>5s} {'layout (the planner chose mbs, v)':36s} {'MFU':>5s} "
          f"{'predicted':>9s} {'error':>6s}")  # fmt: skip
    for r in table:
        print(
            f"{r['run']:20s} {r['gpus']:5d} {r['layout']:36s} {r['published_mfu']:5.0%} "
            f"{r['predicted_mfu']:9.1%} {r['error']:6.1%}"
        )
    print(f"median error {error:.1%} over {len(table) - 1} predicted points")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
