"""Checkpoint save cost: a synchronous save against the stall of --async-save, and what the
checksums recorded for every file cost (the same state written by DCP's plain writer and by
ours, alternately) and what verifying them on load costs (reading every file once).

One process, a model whose checkpoint (fp32 weights + Adam moments) is a few hundred MB.
The stall is the time the training step is blocked: for a synchronous save, the whole save;
for --async-save, the time in save() plus the time the next step waits, before updating the
weights, for the copy to host memory to finish. Reported apart: how much slower that next
step runs than a plain one because the background copy and write share the machine with it
(on a 2-core CPU run, a lot). Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.planning.bench_setup import corpus_dataset, engine_flags
from engine.pretrain import parse
from engine.train.checkpoint import save
from engine.train.iteration import train_iteration
from engine.train.preflight import prepare
from engine.train.setup import setup
from parallel.local_ranks import run_local
from parallel.state import ParallelState


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
    cfg = prepare(parse(flags), 1)
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
        run_.progress.counters.iteration += 1

    for _ in range(args.trials):
        plain = statistics.median(timed(step) for _ in range(3))
        run_.checkpointer.async_save = False
        results["sync"].append(timed(lambda: save(run_)))
        step()
        run_.checkpointer.async_save = True
        call = timed(lambda: save(run_))
        next_step = timed(step)
        rest = timed(run_.checkpointer.wait)
        results["async_call"].append(call)
        results["async_stall"].append(call + run_.checkpointer.copy_wait_s)
        results["async_slowdown"].append(max(0.0, next_step - plain))
        results["async_total"].append(call + next_step + rest)
    results.update(_checksum_cost(run_, save_dir, args.trials))
    size = _folder_bytes(os.path.join(save_dir, f"iter_{run_.progress.last_saved:07d}"))
    params = sum(p.numel() for c in run_.chunks for p in c.params)
    return {k: statistics.median(v) for k, v in results.items()}, size, params


def _checksum_cost(run_, save_dir: str, trials: int) -> dict:
    """Seconds to write this rank's checkpoint state with DCP's plain FileSystemWriter and with
    the ChecksummingWriter the engine uses (alternating, so that both see the same disk and
    page cache), and to verify the written files' checksums."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from engine.checkpoint.files import check_files
    from engine.checkpoint.state import model_state, optimizer_state, rng_state
    from parallel.checkpoint.checksums import ChecksummingWriter
    from parallel.checkpoint.dcp import BoxSavePlanner

    state = model_state(run_.chunks, for_save=True)
    state.update(optimizer_state(run_.optimizer, run_.chunks, for_save=True))
    state.update(rng_state(0, run_.progress.tracker))
    out = {"write_plain": [], "write_checksums": [], "verify": [], "hash_only": []}
    folder = os.path.join(save_dir, "checksum_bench")
    writers = [("write_plain", FileSystemWriter), ("write_checksums", ChecksummingWriter)]
    for trial in range(max(trials, 5)):
        for key, writer_class in writers[:: 1 if trial % 2 else -1]:  # each goes first in turn
            shutil.rmtree(folder, ignore_errors=True)
            writer = writer_class(folder)
            begin = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(state, storage_writer=writer, planner=BoxSavePlanner(), no_dist=True)
            out[key].append(time.perf_counter() - begin)
            if key == "write_checksums":
                begin = time.perf_counter()
                assert check_files(folder, {"files": writer.files}, digests=True) == ""
                out["verify"].append(time.perf_counter() - begin)
        out["hash_only"].append(_hash_seconds(state))
    shutil.rmtree(folder, ignore_errors=True)
    return out


def _hash_seconds(state: dict) -> float:
    """The CPU time xxh3 adds to a save: hashing every byte of the state once, in memory
    (the part of the checksum cost that the noise of disk writes cannot hide)."""
    import xxhash

    from parallel.checkpoint.dcp import BoxTensor

    tensors = [
        t
        for v in state.values()
        for t in ([b for _, b in v.boxes] if isinstance(v, BoxTensor) else [v])
    ]
    begin = time.perf_counter()
    for tensor in tensors:
        xxhash.xxh3_64(tensor.contiguous().view(torch.uint8).numpy()).digest()
    return time.perf_counter() - begin


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
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
    for label, key in (
        ("write, DCP's plain writer", "write_plain"),
        ("write, with checksums (ours)", "write_checksums"),
        ("verify on load (read all + xxh3)", "verify"),
        ("xxh3 of the state in memory", "hash_only"),
    ):
        print(f"{label:34s} {times[key]:8.3f} {times[key] / times['sync']:8.1%}")
    cost = times["write_checksums"] / times["write_plain"] - 1.0
    print(
        f"checksums: {cost:+.1%} against the plain write (median of {max(args.trials, 5)}, "
        f"disk noise included); hashing alone is {times['hash_only'] / times['sync']:.1%} of "
        "the synchronous save"
    )
    with open(args.json, "w") as f:
        json.dump({"params": params, "checkpoint_bytes": size, "seconds": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    run(main)
