"""Seeded training runs compared against a reference, shared by the convergence benchmarks
(tools/bench_fp8.py: FP8 recipes against BF16; tools/bench_optimizers.py: Muon against Adam):
the small Llama-style model's flags, one `engine.pretrain` per process, its losses and times
read back from the JSONL log, the summary over seeds and the plot.

The model: RMSNorm, SwiGLU (3 x hidden), RoPE, no biases, untied output layer, 64-wide heads,
no dropout, bf16; cosine schedule to lr / 10 after 10% warm-up, weight decay 0.1, clipping at
1.0, the data split 98/2/0. The seed sets the initialisation and the data order.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from engine.errors import UserError

REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_run_arguments(parser, *, lr: float | None = None) -> None:
    """The flags the convergence benchmarks share: seeds, the token budget, the model's shape,
    runs at a time, the data and the output folder (and --lr when given a default)."""
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    parser.add_argument("--train-iters", type=int, default=120)
    parser.add_argument("--average-last", type=int, default=10)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=2)
    if lr is not None:
        parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--data-dir", default="data/bench", help="corpus dataset (made once)")
    parser.add_argument("--data-path", default=None, help="another dataset prefix instead")
    parser.add_argument("--tokenizer-model", default=None, help="its SentencePiece model")
    parser.add_argument("--output-dir", default=None, help="JSON and plot (default: a temp dir)")


def prepared(args, name: str) -> tuple[str, str, str]:
    """(dataset prefix, tokenizer model, output folder) of add_run_arguments' flags: the
    built-in corpus's dataset made under --data-dir unless --data-path is given; UserError
    for flags that do not go together."""
    import tempfile

    from engine.planning.bench_setup import corpus_dataset

    if args.average_last > args.train_iters:
        raise UserError(f"--average-last {args.average_last} is more than --train-iters")
    if (args.data_path is None) != (args.tokenizer_model is None):
        raise UserError("--data-path and --tokenizer-model go together; give both or neither")
    if args.data_path is None:
        prefix, tokenizer = corpus_dataset(args.data_dir)
    else:
        prefix, tokenizer = args.data_path, args.tokenizer_model
    out = args.output_dir or tempfile.mkdtemp(prefix=f"{name}_")
    os.makedirs(out, exist_ok=True)
    return prefix, tokenizer, out


def llama_flags(args, prefix: str, tokenizer: str, seed: int, lr: float, log: str) -> list[str]:
    """engine.pretrain's flags for one run of the module docstring's model, shaped by args'
    --num-layers, --hidden-size, --seq-length, --micro-batch-size, --global-batch-size and
    --train-iters."""
    from engine.planning.bench_setup import engine_flags

    flags = engine_flags(
        prefix, tokenizer, args.num_layers, args.hidden_size, args.seq_length,
        args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, lr=lr, min_lr=lr / 10,
        lr_warmup_iters=max(1, args.train_iters // 10), lr_decay_style="cosine",
        weight_decay=0.1, clip_grad=1.0, seed=seed, split="98,2,0", hidden_dropout=0.0,
        attention_dropout=0.0, ffn_hidden_size=3 * args.hidden_size, log_interval=1,
        eval_interval=10**6, eval_iters=0, num_workers=0, make_vocab_size_divisible_by=128,
        log_jsonl=log,
    )  # fmt: skip
    return flags + [
        "--bf16", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    ]  # fmt: skip


def train(flags: list[str], log: str) -> dict:
    """One run in its own process (one thread): {"loss": per step, "step_s": median step
    time, "optimizer_s": median time of the optimizer's step} (the first step left out)."""
    if os.path.exists(log):
        os.remove(log)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPOSITORY)
    done = subprocess.run(
        [sys.executable, "-m", "engine.pretrain", *flags], cwd=REPOSITORY, env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"a training run failed ({' '.join(flags[-4:])}): {last}")
    losses, times, optimizer = {}, [], []
    with open(log) as f:
        for line in f:
            record = json.loads(line)
            if "split" not in record and record.get("lm_loss") is not None:
                losses[record["iteration"]] = record["lm_loss"]
                times.append(record["iteration_time_s"])
                optimizer.append(record.get("time/optimizer", 0.0))
    later = slice(1, None) if len(times) > 1 else slice(None)
    return {
        "loss": [losses[k] for k in sorted(losses)],
        "step_s": statistics.median(times[later]),
        "optimizer_s": statistics.median(optimizer[later]),
    }


def final_loss(run: dict, average_last: int) -> float:
    return statistics.fmean(run["loss"][-average_last:])


def std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def mean_std(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f} +- {std(values):.4f}"


def plot_against(runs: dict[str, list[dict]], reference: str, path: str, title: str) -> None:
    """Above: each run kind's loss curve (mean over seeds); below: each kind's loss minus the
    `reference` kind's of the same seed, mean with a band of one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    base = np.array([run["loss"] for run in runs[reference]])
    steps = np.arange(1, base.shape[1] + 1)
    for number, (kind, seeds) in enumerate(runs.items()):
        curves, color = np.array([run["loss"] for run in seeds]), f"C{number}"
        top.plot(steps, curves.mean(0), label=kind, linewidth=1.2, color=color)
        if kind != reference:
            apart = curves - base
            bottom.plot(steps, apart.mean(0), label=kind, linewidth=1.2, color=color)
            low, high = apart.mean(0) - apart.std(0), apart.mean(0) + apart.std(0)
            bottom.fill_between(steps, low, high, alpha=0.2, color=color)
    top.set_ylabel("training loss (mean over seeds)")
    top.set_title(title)
    top.legend()
    bottom.axhline(0.0, color="black", linewidth=0.8)
    bottom.set_ylabel(f"loss - {reference}'s (same seed)")
    bottom.set_xlabel("step")
    if len(runs) > 1:
        bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
