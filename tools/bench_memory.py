"""Memory per rank, measured on CPU gloo ranks and set against its formula.

Today: activation memory of one transformer layer (the bytes autograd saves for backward, read
with saved-tensor hooks) for TP 1, 2 and 4, with and without sequence parallelism, against
Korthikanti et al.'s count and the same count adjusted for this engine's layer (see
engine/activation_memory.py for the terms). bf16 activations, GPT-2 style layer, flash SDPA
without attention dropout, hidden dropout 0.1. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json

from engine.activation_memory import korthikanti_bytes, layer_activation_bytes, measure_layer
from engine.cli import run_main as run
from engine.config import ModelConfig
from parallel.launch import run_local
from parallel.state import ParallelState

TP_SIZES = (1, 2, 4)


def _measure(rank, world, args):
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        max_position_embeddings=args.seq_length,
        vocab_size=1024,
        hidden_dropout=0.1,
        attention_dropout=0.0,
    )
    rows = []
    for tp in TP_SIZES:
        state = ParallelState.build(tp=tp)
        for sp in (False, True) if tp > 1 else (False,):
            rows.append((tp, sp, measure_layer(cfg, state.tp_group, tp, sp, args.micro_batch_size)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--json", default="bench_memory.json")
    args = parser.parse_args(argv)
    s, b, h, a = args.seq_length, args.micro_batch_size, args.hidden_size, args.num_attention_heads
    rows = run_local(_measure, max(TP_SIZES), args)[0]
    mib = 2**20
    print(f"Activation bytes saved for backward per layer and rank: s={s} b={b} h={h} a={a}, bf16")
    print("| TP | SP | measured MiB | adjusted formula MiB | measured / formula | paper MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    table = []
    for tp, sp, measured in rows:
        formula = layer_activation_bytes(s, b, h, a, tp, sp)
        paper = korthikanti_bytes(s, b, h, a, tp, sp)
        table.append({"tp": tp, "sp": sp, "measured": measured, "formula": formula, "paper": paper})
        print(
            f"| {tp} | {'yes' if sp else 'no'} | {measured / mib:.2f} | {formula / mib:.2f} | "
            f"{measured / formula:.3f} | {paper / mib:.2f} |"
        )
    with open(args.json, "w") as f:
        json.dump({"activations": table, "shape": {"s": s, "b": b, "h": h, "a": a}}, f, indent=1)
    return 0


if __name__ == "__main__":
    run(main)
