"""FP8 against BF16 on the built-in corpus: does each FP8 recipe train like BF16?

The same small Llama-style model (engine/planning/training_runs.py) is trained on the
built-in corpus (Python standard-library sources, engine/planning/bench_setup.py)
for --train-iters steps of one global batch each (a fixed token budget), in BF16 and in BF16
with each FP8 recipe of --recipes (Megatron-LM's --fp8-recipe, with --fp8-format), over
--seeds seeds (the initialisation and the data order both follow the seed). Each run is
`python -m engine.pretrain` in a process of its own, one thread each, --parallel at a time.

Prints, per recipe, the final loss (mean of the last --average-last steps' losses) as mean +-
standard deviation over the seeds, its difference from BF16's run of the same seed (mean and
standard deviation; issue 48's goal: within 0.01), and the median step time over BF16's (on a
CPU only the cost of the scaling and the emulated block products: no FP8 hardware). Writes
JSON and one plot: the loss curves, and each recipe's difference from BF16 step by step.
"""

from __future__ import annotations

import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import UserError
from engine.planning.training_runs import (
    add_run_arguments,
    final_loss,
    llama_flags,
    plot_against,
    prepared,
    std,
    train,
)

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def run_flags(args, prefix: str, tokenizer: str, recipe: str, seed: int, log: str) -> list[str]:
    """engine.pretrain's flags for one run (recipe "bf16": no FP8)."""
    flags = llama_flags(args, prefix, tokenizer, seed, args.lr, log)
    if recipe != "bf16":
        flags += ["--fp8-format", args.fp8_format, "--fp8-recipe", recipe]
    return flags


def summarise(runs: dict[str, list[dict]], average_last: int) -> list[dict]:
    """A row per recipe: final loss mean and std over seeds, and its difference from BF16's
    run of the same seed (same initialisation, same data), mean and std over the seeds."""
    finals = {
        recipe: [final_loss(run, average_last) for run in seeds] for recipe, seeds in runs.items()
    }
    bf16_step = statistics.median(run["step_s"] for run in runs["bf16"])
    rows = []
    for recipe, values in finals.items():
        apart = [value - bf16 for value, bf16 in zip(values, finals["bf16"], strict=True)]
        rows.append({
            "recipe": recipe,
            "final_loss_mean": statistics.fmean(values),
            "final_loss_std": std(values),
            "minus_bf16_mean": statistics.fmean(apart),
            "minus_bf16_std": std(apart),
            "step_over_bf16": statistics.median(r["step_s"] for r in runs[recipe]) / bf16_step,
        })  # fmt: skip
    return rows


def print_table(rows: list[dict], args) -> None:
    tokens = args.train_iters * args.global_batch_size * args.seq_length
    print(f"final loss (mean of the last {args.average_last} steps), {len(args.seeds)} seeds, "
          f"{tokens:,} tokens, FP8 format {args.fp8_format}; '- bf16': against BF16's run of "
          "the same seed")  # fmt: skip
    print(f"{'recipe':>10}  {'final loss':>17}  {'- bf16':>17}  {'step / bf16':>11}")
    for row in rows:
        loss = f"{row['final_loss_mean']:.4f} +- {row['final_loss_std']:.4f}"
        apart = f"{row['minus_bf16_mean']:+.4f} +- {row['minus_bf16_std']:.4f}"
        print(f"{row['recipe']:>10}  {loss:>17}  {apart:>17}  {row['step_over_bf16']:11.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default="hybrid")
    add_run_arguments(parser, lr=3e-3)
    args = parser.parse_args(argv)
    if args.hidden_size % 128:
        raise UserError(f"--hidden-size {args.hidden_size}: blockwise FP8 needs a multiple of 128")
    prefix, tokenizer, out = prepared(args, "bench_fp8")
    jobs = [(recipe, seed) for recipe in ["bf16", *args.recipes] for seed in args.seeds]

    def one(job):
        log = os.path.join(out, f"{job[0]}-{job[1]}.jsonl")
        return train(run_flags(args, prefix, tokenizer, *job, log), log)

    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(one, jobs))
    runs: dict[str, list[dict]] = {}
    for (recipe, _), result in zip(jobs, results, strict=True):
        runs.setdefault(recipe, []).append(result)
    rows = summarise(runs, args.average_last)
    print_table(rows, args)
    with open(os.path.join(out, "bench_fp8.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "runs": runs}, f, indent=1)
    title = (f"FP8 ({args.fp8_format}) vs BF16: {args.num_layers} layers x {args.hidden_size}, "
             f"{len(args.seeds)} seeds")  # fmt: skip
    plot_against(runs, "bf16", os.path.join(out, "bench_fp8.png"), title)
    print(f"wrote {out}/bench_fp8.json and bench_fp8.png")
    return 0


if __name__ == "__main__":
    run_main(main)
