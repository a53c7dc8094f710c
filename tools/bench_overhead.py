"""Engine overhead: time per training step of the engine against a bare PyTorch loop.

One process, the same model (GPTModel), the same micro-batches. The bare loop is forward,
backward, AdamW written out here; the engine step adds what a real run does: DDP grad buffers
and hooks, the schedule, gradient finalization, the loss made known to every rank, NaN/spike
checks, clipping through the distributed optimizer. Steps alternate between the two to share
the machine's noise; prints a table and writes JSON.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import torch

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.model import BuildContext, GPTModel
from engine.optim.optimizer import no_weight_decay
from engine.planning.bench_setup import corpus_dataset, engine_flags
from engine.pretrain import parse
from engine.train.iteration import train_iteration
from engine.train.preflight import prepare
from engine.train.setup import setup
from parallel.local_ranks import run_local
from parallel.state import ParallelState


def _bench(rank, world, args, prefix, tokenizer):
    torch.set_num_threads(args.threads)
    flags = engine_flags(
        prefix,
        tokenizer,
        args.num_layers,
        args.hidden_size,
        args.seq_length,
        args.micro_batch_size,
        global_batch_size=str(args.micro_batch_size * args.accumulation),
        train_iters="1000",
        lr="1e-4",
        lr_decay_style="constant",
        hidden_dropout="0.0",
        attention_dropout="0.0",
        clip_grad="1.0",
    )
    cfg = prepare(parse(flags), 1)
    engine = setup(cfg, ParallelState.build(1, 1))
    bare = GPTModel(cfg.model, BuildContext(cfg.model))
    params = list(bare.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if not no_weight_decay(p)], "weight_decay": 0.01},
            {"params": [p for p in params if no_weight_decay(p)], "weight_decay": 0.0},
        ],
        lr=1e-4,
        foreach=True,
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0,
        cfg.model.vocab_size,
        (args.accumulation, args.micro_batch_size, args.seq_length + 1),
        generator=generator,
    )
    batches = [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]

    def bare_step():
        optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            loss = bare(batch["tokens"], batch["labels"]).mean() / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def engine_step():
        train_iteration(engine, batches)
        engine.progress.counters.iteration += 1

    times = {"bare": [], "engine": []}
    for step in range(args.warmup + args.steps):
        for name, fn in (("bare", bare_step), ("engine", engine_step)):
            start = time.perf_counter()
            fn()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}, sum(p.numel() for p in params)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--json", default="bench_overhead.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        prefix, tokenizer = corpus_dataset(tmp)
        times, params = run_local(
            _bench, 1, args, prefix, tokenizer, timeout=3600, threads=args.threads
        )[0]
    ratio = times["engine"] / times["bare"]
    print(
        f"model: {params / 1e6:.1f}M parameters; {args.accumulation} micro-batches of "
        f"{args.micro_batch_size} x {args.seq_length} tokens per step; {args.threads} threads"
    )
    print(f"{'loop':28s} {'s/step (median)':>16s} {'ratio':>7s}")
    print(f"{'bare PyTorch':28s} {times['bare']:16.4f} {1.0:7.3f}")
    print(f"{'engine (train_iteration)':28s} {times['engine']:16.4f} {ratio:7.3f}")
    with open(args.json, "w") as f:
        json.dump({"params": params, "seconds": times, "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    run(main)
