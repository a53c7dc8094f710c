"""Pipeline bubble on CPU gloo: GPipe, 1F1B, interleaved 1F1B, the zero-bubble ZB-H1 and ZB-V,
and DualPipeV against their ideal times.

For p stages and m micro-batches, the single-stage time t (forward + backward of one stage on
one micro-batch) gives the ideal step time m * t / e, with e = 1 - the schedule's bubble as its
table simulates it with forward 1, backward 2 (input and weight gradients 1 each) per chunk
(parallel/pipeline/validate.py): m / (m + p - 1) for GPipe and 1F1B, m / (m + (p - 1) / v) for
interleaved 1F1B with v virtual stages (run with blocking transfers, and with
--overlap-p2p-communication), less for the schedules that split backward.
t is measured inside each run (the slowest stage's compute time / m, so it sees the same
caches, clocks and core sharing as the step), and also alone beforehand for reference.
Measured bubble = 1 - m * t / measured step time. Stages are balanced (a small vocabulary keeps
embedding and output cheap). One thread per rank; with fewer cores than stages the ranks share
cores and idle stages lend theirs to busy ones, so such runs understate the bubble.
Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.model import BuildContext, GPTModel
from engine.model.builder import build_model_chunks
from engine.planning.bench_setup import bench_model_config
from engine.train.step import run_schedule
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.errors import ConfigError
from parallel.local_ranks import run_local
from parallel.pipeline.schedules import get_schedule
from parallel.pipeline.tables import PLACEMENT, build_table, default_chunks
from parallel.pipeline.validate import simulate
from parallel.state import ParallelState

OVERLAP = "interleaved+overlap"  # --overlap-p2p-communication
SCHEDULES = ["gpipe", "1f1b", "interleaved", OVERLAP, "zb-h1", "zb-v", "dualpipe-v"]


def _stage_time(rank, world, args):
    """Forward + backward of num_layers / p layers on one micro-batch, alone on one thread."""
    cfg = bench_model_config(args, make_vocab_size_divisible_by=64)
    layers = range(args.num_layers // args.pp)
    model = GPTModel(
        cfg, BuildContext(cfg), pre_process=False, post_process=False, layer_numbers=layers
    )
    x = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size)
    times = []
    for i in range(args.warmup + 3 * args.steps):
        hidden = x.clone().requires_grad_(True)
        start = time.perf_counter()
        model(hidden=hidden).square().mean().backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pipeline_time(rank, world, args, kind, m):
    state = ParallelState.build(tp=1, pp=world)
    cfg = bench_model_config(args, make_vocab_size_divisible_by=64)
    schedule_kind = "interleaved" if kind == OVERLAP else kind
    v = default_chunks(schedule_kind)
    chunks = build_model_chunks(
        cfg, state, virtual_size=v, placement=PLACEMENT.get(schedule_kind, "loop")
    )
    ddps = [DistributedDataParallel(c, None) for c in chunks]
    stats: dict = {}
    schedule = get_schedule(
        state,
        virtual_size=v,
        kind=schedule_kind,
        overlap_p2p=kind == OVERLAP,
        tensor_shape=(args.seq_length, args.micro_batch_size, args.hidden_size),
        dtype=torch.float32,
        stats=stats,
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, args.vocab_size, (m * args.micro_batch_size, args.seq_length + 1), generator=generator
    )
    batches = [
        {
            "tokens": tokens[i : i + args.micro_batch_size, :-1],
            "labels": tokens[i : i + args.micro_batch_size, 1:],
        }
        for i in range(0, len(tokens), args.micro_batch_size)
    ]
    times, computes = [], []
    for step in range(args.warmup + args.steps):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        dist.barrier()
        start = time.perf_counter()
        run_schedule(ddps, batches, schedule)
        measured = torch.tensor([time.perf_counter() - start, stats["compute_s"]])
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(measured[0].item())
            computes.append(measured[1].item())
    return statistics.median(times), statistics.median(computes) / m


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--json", default="bench_pipeline.json")
    args = parser.parse_args(argv)
    p = args.pp
    alone = run_local(_stage_time, 1, args, timeout=3600)[0]
    rows = []
    for m in args.microbatches:
        for kind in args.schedules:
            schedule_kind = "interleaved" if kind == OVERLAP else kind
            try:
                table = build_table(schedule_kind, p, default_chunks(schedule_kind), m)
            except ConfigError:  # interleaved: m % p; zb-v, dualpipe-v: m too small
                continue
            measured, stage = run_local(_pipeline_time, p, args, kind, m, timeout=3600)[0]
            ideal_efficiency = 1 - max(simulate(table).bubble)
            ideal = m * stage / ideal_efficiency
            rows.append(
                {
                    "m": m,
                    "schedule": kind,
                    "measured_s": measured,
                    "stage_s": stage,
                    "ideal_s": ideal,
                    "measured_bubble": 1 - m * stage / measured,
                    "ideal_bubble": 1 - ideal_efficiency,
                }
            )
    print(
        f"p={p} stages, v=2 for interleaved, zb-v and dualpipe-v; {os.cpu_count()} CPU cores; "
        f"stage time alone: {alone * 1e3:.1f} ms per micro-batch (forward + backward, one thread)"
    )
    print(
        f"{'m':>3s} {'schedule':20s} {'t (ms)':>7s} {'measured s':>10s} {'ideal s':>8s} "
        f"{'bubble':>7s} {'ideal':>7s} {'gap (pp)':>8s}"
    )
    for r in rows:
        gap = 100 * (r["measured_bubble"] - r["ideal_bubble"])
        print(
            f"{r['m']:3d} {r['schedule']:20s} {r['stage_s'] * 1e3:7.1f} "
            f"{r['measured_s']:10.3f} {r['ideal_s']:8.3f} {r['measured_bubble']:7.1%} "
            f"{r['ideal_bubble']:7.1%} {gap:8.1f}"
        )
    with open(args.json, "w") as f:
        json.dump(
            {"pp": p, "stage_alone_s": alone, "cpu_cores": os.cpu_count(), "rows": rows},
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    run(main)
