"""Checkpoint save cost: a synchronous save against the stall of --async-save.

One process, a model whose checkpoint (fp32 weights + Adam moments) is a few hundred MB.
The stall is the time the training step is blocked: for a synchronous save, the whole save;
for --async-save, the time in save() plus the time the next step waits, before updating the
weights, for the copy to host memory to finish. Reported apart: how much slower that next
step runs than a plain one because the background copy and write share the machine with it
(on a 2-core CPU run, a lot). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from engine.cli import run_main as run
from engine.pretrain import check, parse
from engine.training import save, setup, train_iteration
from parallel.launch import run_local
from parallel.state import ParallelState

if __package__:  # imported as tools.bench_checkpoint (from the repository root, as tests do)
    from ._bench_data import corpus_dataset, engine_flags
else:  # run as `python tools/bench_checkpoint.py`: tools/ is sys.path[0]
    from _bench_data import corpus_dataset, engine_flags


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
    results = {
        "sync": [],
        "async_call": [],
        "async_stall": [],
        "async_slowdown": [],
        "async_total": [],
    }

    def timed(fn):
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    def step():
        train_iteration(run_, batches)
        run_.counters.iteration += 1

    for _ in range(args.trials):
        plain = statistics.median(timed(step) for _ in range(3))
        run_.cfg.train.async_save = run_.checkpointer.async_save = False
        results["sync"].append(timed(lambda: save(run_)))
        step()
        run_.cfg.train.async_save = run_.checkpointer.async_save = True
        call = timed(lambda: save(run_))
        next_step = timed(step)
        rest = timed(run_.checkpointer.wait)
        results["async_call"].append(call)
        results["async_stall"].append(call + run_.checkpointer.copy_wait_s)
        results["async_slowdown"].append(max(0.0, next_step - plain))
        results["async_total"].append(call + next_step + rest)
    size = _folder_bytes(os.path.join(save_dir, f"iter_{run_.last_saved:07d}"))
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
    for label, key in (
        ("async: time in save()", "async_call"),
        ("async: stall (save() + copy wait)", "async_stall"),
        ("async: next step slower (sharing)", "async_slowdown"),
        ("async: until written (background)", "async_total"),
    ):
        print(f"{label:34s} {times[key]:8.3f} {times[key] / times['sync']:8.1%}")
    with open(args.json, "w") as f:
        json.dump({"params": params, "checkpoint_bytes": size, "seconds": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    run(main)
