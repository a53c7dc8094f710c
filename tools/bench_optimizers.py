"""Muon against Adam on the built-in corpus: which trains the same model further on the same
tokens, each at its best learning rate, and what Newton-Schulz costs.

The same small Llama-style model (engine/planning/training_runs.py) is trained on the
built-in corpus for --train-iters steps of one global batch each (a fixed token budget) with
Adam (--optimizer adam) and with Muon (--optimizer muon: Muon for the 2-D hidden weights,
AdamW for the embeddings, the output layer and the norms), each at the three learning rates of
--adam-lrs / --muon-lrs, over --seeds seeds (the initialisation and the data order follow the
seed). Muon runs with megatron-core's defaults but --muon-extra-scale-factor (0.2 by default,
Moonlight's match of AdamW's update RMS, so that one learning rate serves both of its parts).
Each run is `python -m engine.pretrain` in a process of its own, one thread, --parallel at a
time.

Prints a row per optimizer and learning rate: the final loss (mean of the last --average-last
steps' losses) as mean +- standard deviation over the seeds, the best rate of each marked;
then at each one's best rate, Muon's final loss minus Adam's of the same seed, the step time
over Adam's, and Newton-Schulz's share of Muon's step (Muon's optimizer step time minus
Adam's, over Muon's whole step; medians). Writes JSON and one plot: both loss curves at their
best rates, and Muon's difference from Adam step by step.
"""

from __future__ import annotations

import json
import os
import statistics
from concurrent.futures import ThreadPoolExecutor

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.planning.training_runs import (
    add_run_arguments,
    final_loss,
    llama_flags,
    mean_std,
    plot_against,
    prepared,
    std,
    train,
)

OPTIMIZERS = ("adam", "muon")


def run_flags(args, prefix: str, tokenizer: str, job: tuple, log: str) -> list[str]:
    optimizer, lr, seed = job
    flags = llama_flags(args, prefix, tokenizer, seed, lr, log) + ["--optimizer", optimizer]
    if optimizer == "muon":
        flags += ["--muon-extra-scale-factor", str(args.muon_extra_scale_factor)]
    return flags


def summarise(runs: dict[tuple, list[dict]], average_last: int) -> dict:
    """{"rows": per (optimizer, lr), "best": each optimizer's best lr, "comparison": Muon at
    its best against Adam at its best}."""
    rows = []
    for (optimizer, lr), seeds in runs.items():
        finals = [final_loss(run, average_last) for run in seeds]
        rows.append({
            "optimizer": optimizer, "lr": lr, "finals": finals,
            "final_loss_mean": statistics.fmean(finals), "final_loss_std": std(finals),
            "step_s": statistics.median(run["step_s"] for run in seeds),
            "optimizer_s": statistics.median(run["optimizer_s"] for run in seeds),
        })  # fmt: skip
    best = {}
    for name in OPTIMIZERS:
        mine = [row for row in rows if row["optimizer"] == name]
        if mine:
            best[name] = min(mine, key=lambda row: row["final_loss_mean"])
    comparison = None
    if len(best) == 2:
        adam, muon = best["adam"], best["muon"]
        apart = [m - a for m, a in zip(muon["finals"], adam["finals"], strict=True)]
        comparison = {
            "muon_minus_adam_mean": statistics.fmean(apart),
            "muon_minus_adam_std": std(apart),
            "step_over_adam": muon["step_s"] / adam["step_s"],
            "newton_schulz_share": (muon["optimizer_s"] - adam["optimizer_s"]) / muon["step_s"],
        }
    return {"rows": rows, "best": {k: v["lr"] for k, v in best.items()}, "comparison": comparison}


def print_table(summary: dict, args) -> None:
    tokens = args.train_iters * args.global_batch_size * args.seq_length
    print(f"final loss (mean of the last {args.average_last} steps), {len(args.seeds)} seeds, "
          f"{tokens:,} tokens; * the best rate of each optimizer")  # fmt: skip
    print(f"{'optimizer':>9}  {'lr':>8}  {'final loss':>17}  {'step s':>7}  {'optimizer s':>11}")
    for row in summary["rows"]:
        mark = "*" if summary["best"].get(row["optimizer"]) == row["lr"] else " "
        loss = mean_std(row["finals"])
        print(f"{row['optimizer']:>9}  {row['lr']:>8g}{mark} {loss:>17}  {row['step_s']:7.3f}  "
              f"{row['optimizer_s']:11.4f}")  # fmt: skip
    found = summary["comparison"]
    if found is not None:
        print(f"Muon at its best rate minus Adam at its best (same seeds): "
              f"{found['muon_minus_adam_mean']:+.4f} +- {found['muon_minus_adam_std']:.4f}; "
              f"step time over Adam's {found['step_over_adam']:.2f}; Newton-Schulz "
              f"{100 * found['newton_schulz_share']:.1f}% of Muon's step")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon-extra-scale-factor", type=float, default=0.2)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    prefix, tokenizer, out = prepared(args, "bench_optimizers")
    rates = {"adam": args.adam_lrs, "muon": args.muon_lrs}
    jobs = [(name, lr, seed) for name in args.optimizers for lr in rates[name]
            for seed in args.seeds]  # fmt: skip

    def one(job):
        log = os.path.join(out, "{}-{:g}-{}.jsonl".format(*job))
        return train(run_flags(args, prefix, tokenizer, job, log), log)

    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(one, jobs))
    runs: dict[tuple, list[dict]] = {}
    for (name, lr, _), result in zip(jobs, results, strict=True):
        runs.setdefault((name, lr), []).append(result)
    summary = summarise(runs, args.average_last)
    print_table(summary, args)
    with open(os.path.join(out, "bench_optimizers.json"), "w") as f:
        named = {f"{name} {lr:g}": seeds for (name, lr), seeds in runs.items()}
        json.dump({"args": vars(args), **summary, "runs": named}, f, indent=1)
    at_best = {f"{name} (lr {lr:g})": runs[(name, lr)] for name, lr in summary["best"].items()}
    title = (f"Muon vs Adam at their best rates: {args.num_layers} layers x "
             f"{args.hidden_size}, {len(args.seeds)} seeds")  # fmt: skip
    plot_against(at_best, next(iter(at_best)), os.path.join(out, "bench_optimizers.png"), title)
    print(f"wrote {out}/bench_optimizers.json and bench_optimizers.png")
    return 0


if __name__ == "__main__":
    run_main(main)
