"""Checkpoint save cost: a synchronous save against the stall of --async-save.

One process, a model whose checkpoint (fp32 weights + Adam moments) is a few hundred MB.
The stall is what the training step waits for: with --async-save only the copy to host
memory; the writing happens in a background thread. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from engine.pretrain import check, parse
from engine.training import save, setup, train_iteration
from parallel.launch import run_local
from parallel.state import ParallelState
from tools._bench_data import corpus_dataset, engine_flags
from tools._cli import run


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _bench(rank, world, args, prefix, tokenizer, save_dir):
    flags = engine_flags(
        prefix,
        tokenizer,
        args.num_layers,
        args.hidden_size,
        64,
        1,
        train_iters="100",
        save=save_dir,
        keep_last_n="1",
    )
    cfg = parse(flags)
    check(cfg, 1)
    run_ = setup(cfg, ParallelState.build(1, 1))
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 65))
    batches = [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}]
    results = {"sync": [], "async_stall": [], "async_total": []}
    for _ in range(args.trials):
        train_iteration(run_, batches)
        for mode in ("sync", "async"):
            run_.counters.iteration += 1
            run_.cfg.train.async_save = run_.checkpointer.async_save = mode == "async"
            start = time.perf_counter()
            save(run_)
            stall = time.perf_counter() - start
            run_.checkpointer.wait()
            total = time.perf_counter() - start
            if mode == "sync":
                results["sync"].append(stall)
            else:
                results["async_stall"].append(stall)
                results["async_total"].append(total)
    size = _folder_bytes(os.path.join(save_dir, f"iter_{run_.counters.iteration:07d}"))
    params = sum(p.numel() for c in run_.chunks for p in c.params)
    return {k: statistics.median(v) for k, v in results.items()}, size, params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--save-dir", help="where to write (default: a temporary folder)")
    parser.add_argument("--json", default="bench_checkpoint.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        prefix, tokenizer = corpus_dataset(tmp)
        save_dir = args.save_dir or os.path.join(tmp, "ckpt")
        times, size, params = run_local(
            _bench, 1, args, prefix, tokenizer, save_dir, timeout=3600, threads=2
        )[0]
    print(
        f"model: {params / 1e6:.1f}M parameters; checkpoint {size / 1e6:.0f} MB "
        f"(fp32 weights + Adam moments + RNG); median of {args.trials}"
    )
    print(f"{'save':34s} {'seconds':>8s} {'vs sync':>8s}")
    print(f"{'synchronous (step stalled)':34s} {times['sync']:8.3f} {1.0:8.1%}")
    print(
        f"{'async: step stalled (host copy)':34s} {times['async_stall']:8.3f} "
        f"{times['async_stall'] / times['sync']:8.1%}"
    )
    print(
        f"{'async: until written (background)':34s} {times['async_total']:8.3f} "
        f"{times['async_total'] / times['sync']:8.1%}"
    )
    with open(args.json, "w") as f:
        json.dump({"params": params, "checkpoint_bytes": size, "seconds": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    run(main)
