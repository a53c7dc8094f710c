"""Causal attention vs attention within documents (--reset-attention-mask --reset-position-ids)
on samples packed from documents of mixed lengths: a small Llama-style model's forward and
backward time per micro-batch, in one process and with context parallelism (ring attention
over gloo ranks, one thread each), and the attention work, counted in (query, key) pairs:
the share documents leave of the causal work, and how evenly the CP ranks' load-balanced
chunks share it (max / mean). Prints a table and writes JSON.

    python tools/bench_attention.py                 # seq 2048 and 8192, CP 1 and 2
    python tools/bench_attention.py --tiny          # small shapes (the test's)
"""

from __future__ import annotations

import json

import torch

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import InputError
from engine.planning.attention_bench import attention_model_config, context_parallel, one_process
from engine.planning.attention_work import attention_work, mixed_documents
from parallel.local_ranks import run_local


def measure(seq: int, cp: int, args) -> dict:
    cfg = attention_model_config(seq, args.num_layers, args.hidden_size)
    layout = mixed_documents(args.micro_batch_size, seq, args.median_length, seed=seq)
    times = {}
    for mode in ("causal", "documents"):
        documents = mode == "documents"
        if cp == 1:
            times[mode] = one_process(cfg, layout, documents, args.steps)
        else:
            ranks = run_local(
                context_parallel, cp, cfg, layout, documents, args.steps, timeout=3600
            )
            times[mode] = max(ranks)
    work = attention_work(layout, cp)
    causal = attention_work(layout.clone().fill_(1), cp)  # one document: causal per rank
    return {
        "seq": seq,
        "cp": cp,
        "causal_s": times["causal"],
        "documents_s": times["documents"],
        "time_ratio": times["documents"] / times["causal"],
        "documents_per_sample": work.documents_per_sample,
        "work_kept": work.kept,
        "causal_rank_imbalance": causal.imbalance,
        "documents_rank_imbalance": work.imbalance,
    }


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="CP sizes to measure")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--median-length", type=float, default=400.0, help="documents' median")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    parser.add_argument("--tiny", action="store_true", help="seq 256 and 512, one step")
    parser.add_argument("--json", default="bench_attention.json")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq_lengths, args.steps, args.hidden_size, args.median_length = [256, 512], 1, 128, 60
    for seq in args.seq_lengths:
        for cp in args.cp:
            if cp < 1 or seq % (2 * cp):
                raise InputError(f"--cp {cp}: seq length {seq} must divide into 2 x CP chunks")
    torch.set_num_threads(1)
    rows = [measure(seq, cp, args) for seq in args.seq_lengths for cp in args.cp]
    print(
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, head dim 64; micro-batch "
        f"{args.micro_batch_size}; documents of log-normal lengths (median "
        f"{args.median_length:.0f} tokens); forward + backward, median of {args.steps}; one "
        "thread per process"
    )
    head = "  seq  CP  causal s  documents s  ratio  docs/sample  work kept  CP max/mean"
    print(head + " (causal -> documents)")
    for r in rows:
        balance = f"{r['causal_rank_imbalance']:.3f} -> {r['documents_rank_imbalance']:.3f}"
        print(
            f"{r['seq']:5d} {r['cp']:3d} {r['causal_s']:9.3f} {r['documents_s']:12.3f} "
            f"{r['time_ratio']:6.2f} {r['documents_per_sample']:12.1f} "
            f"{r['work_kept']:10.1%}  {balance}"
        )
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
