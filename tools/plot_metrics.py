"""Draw the loss and learning-rate curves of a run (its --log-jsonl file) into a PNG."""

from __future__ import annotations

import argparse
import json
import os

from engine.cli import run_main as run
from engine.errors import InputError


def read_log(path: str) -> tuple[list[dict], list[dict]]:
    train, evals = [], []
    try:
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise InputError(f"{path}:line {number}: not JSON") from None
                (evals if "split" in record else train).append(record)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; pass the run's --log-jsonl file") from None
    if not train:
        raise InputError(f"{path}: no training records")
    return train, evals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log-jsonl", required=True, help="metrics written by --log-jsonl")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    train, evals = read_log(args.log_jsonl)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    points = [(r["iteration"], r["lm_loss"]) for r in train if r.get("lm_loss") is not None]
    loss_ax.plot(*zip(*points), label="train", linewidth=1.5)
    for split in sorted({r["split"] for r in evals}):
        values = [(r["iteration"], r["lm_loss"]) for r in evals if r["split"] == split]
        loss_ax.plot(*zip(*values), "o--", label=split)
    loss_ax.set_ylabel("lm loss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    lr_ax.plot([r["iteration"] for r in train], [r["lr"] for r in train], color="tab:green")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("iteration")
    lr_ax.grid(alpha=0.3)
    fig.suptitle(args.title or os.path.basename(args.log_jsonl))
    fig.tight_layout()
    tmp = f"{args.output}.tmp.{os.getpid()}.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run(main)
