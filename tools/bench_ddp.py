"""Weak-scaling efficiency of data parallelism on CPU gloo.

The per-rank batch stays fixed; efficiency = time per step at DP=1 / time per step at DP=N
(1.0 means the gradient reduction costs nothing). Measured for each data-parallel sharding
strategy (no_shard, optim = --use-distributed-optimizer, optim_grads, optim_grads_params; see
parallel/data_parallel/ddp.py), with the reduction overlapped with backward (--overlap-grad-reduce)
and without, one thread per rank, all in one run. A row of N
independent DP=1 runs side by side (no reduction at all) separates what sharing the machine's
cores, caches and memory bandwidth costs from what the reduction costs. Prints a table (median
over launches, and each launch) and writes JSON.
"""

from __future__ import annotations

import json
import statistics
from concurrent.futures import ThreadPoolExecutor

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.errors import InputError
from engine.model.builder import build_model_chunks
from engine.planning.bench_setup import bench_model_config
from engine.planning.bench_steps import bench_optimizer, timed_steps
from parallel.data_parallel.ddp import STRATEGIES, DistributedDataParallel
from parallel.local_ranks import run_local
from parallel.state import ParallelState


def _bench(rank, world, args, overlap, sharding="no_shard"):
    state = ParallelState.build(tp=1)
    cfg = bench_model_config(args)
    chunks = build_model_chunks(cfg, state)
    ddps = [
        DistributedDataParallel(
            c,
            state.dp_group,
            bucket_size=args.bucket_size,
            overlap_grad_reduce=overlap,
            sharding=sharding,
        )
        for c in chunks
    ]
    optimizer, scheduler = bench_optimizer(ddps, state, distributed=sharding != "no_shard")
    times = timed_steps(
        ddps, optimizer, scheduler, state, warmup=args.warmup, steps=args.steps,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        vocab_size=args.vocab_size, accumulation=args.accumulation, seed=rank,
    )  # fmt: skip
    params = sum(p.numel() for p in ddps[0].params)
    return statistics.median(times), params, len(ddps[0].buckets)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size to compare with 1")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--bucket-size", type=int, default=1_000_000, help="elements per bucket")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="launches of each configuration")
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated sharding strategies to measure at DP=N",
    )
    parser.add_argument("--json", default="bench_ddp.json")
    args = parser.parse_args(argv)

    # Each run is repeated, the runs interleaved, and the median taken: launches on a shared
    # machine vary more than the steps within one launch.
    strategies = args.strategies.split(",")
    for strategy in strategies:
        if strategy not in STRATEGIES:
            raise InputError(f"--strategies: {strategy!r} is not one of {', '.join(STRATEGIES)}")

    def name(strategy, overlap):
        return f"DP={args.dp} {strategy}, overlap {'on' if overlap else 'off'}"

    runs = {"DP=1 (baseline)": [], f"{args.dp} x DP=1 side by side": []}
    runs |= {name(s, o): [] for s in strategies for o in (False, True)}
    for _ in range(args.repeats):
        base, params, buckets = run_local(_bench, 1, args, False, timeout=1800)[0]
        runs["DP=1 (baseline)"].append(base)
        with ThreadPoolExecutor(args.dp) as pool:
            alone = [pool.submit(run_local, _bench, 1, args, False) for _ in range(args.dp)]
            runs[f"{args.dp} x DP=1 side by side"].append(max(f.result()[0][0] for f in alone))
        for strategy in strategies:
            for overlap in (False, True):
                times = run_local(_bench, args.dp, args, overlap, strategy, timeout=1800)
                runs[name(strategy, overlap)].append(max(t for t, _, _ in times))
    base = statistics.median(runs["DP=1 (baseline)"])
    rows = [
        (name, statistics.median(t), base / statistics.median(t), t) for name, t in runs.items()
    ]
    print(
        f"model: {params / 1e6:.1f}M parameters in {buckets} buckets; per-rank batch "
        f"{args.micro_batch_size} x {args.accumulation} x {args.seq_length} tokens; gloo, "
        "one thread per rank"
    )
    print(f"{'run':40s} {'s/step':>8s} {'efficiency':>10s}  {'each launch (s/step)'}")
    for run_name, seconds, efficiency, each in rows:
        spread = " ".join(f"{t:.3f}" for t in each)
        print(f"{run_name:40s} {seconds:8.3f} {efficiency:10.1%}  {spread}")
    with open(args.json, "w") as f:
        json.dump(
            {
                "params": params,
                "rows": [
                    {"run": n, "seconds_per_step": s, "efficiency": e, "each_launch": t}
                    for n, s, e, t in rows
                ],
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    run(main)
