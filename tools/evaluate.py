"""Evaluate a checkpoint: perplexity on a preprocessed dataset and zero/few-shot multiple-choice
accuracy on local task files, by log-likelihood as lm-evaluation-harness scores them.

  python tools/evaluate.py --load SAVE_DIR_OR_HF_FOLDER \\
      [--tasks hellaswag.jsonl arc.jsonl] [--num-fewshot K] \\
      [--perplexity-data PREFIX --perplexity-windows N] [--output-json results.json]

--load takes our checkpoint (saved under any parallel layout; the latest iteration unless
--iteration) or a Hugging Face folder. A task file holds one question a line:
{"context": ..., "choices": [...], "gold": i}; see engine/eval/multiple_choice.py.

--watch scores every checkpoint of a training run's --save folder as it appears (a separate
evaluation job beside training): those already there first, then each new one, polling every
--watch-poll seconds, until none has appeared for --watch-timeout seconds or the one at
--watch-until-iteration is scored. Each checkpoint's results are a line of --output-jsonl (with
its iteration), and a restarted watch skips the iterations that file already holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.tokenizers.cli import (
    add_tokenizer_arguments,
    tokenizer_config,
    tokenizer_flags_given,
)
from engine.errors import CheckpointError, ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", required=True, help="our checkpoint folder or a HF folder")
    parser.add_argument("--iteration", type=int, help="which iteration (default: the latest)")
    parser.add_argument("--tasks", nargs="*", default=[], help="multiple-choice task files")
    parser.add_argument("--num-fewshot", type=int, default=0, help="solved examples per question")
    parser.add_argument("--fewshot-seed", type=int, default=1234, help="draws the examples")
    parser.add_argument("--target-delimiter", default=" ", help="between context and choice")
    parser.add_argument("--fewshot-delimiter", default="\n\n", help="between examples")
    parser.add_argument("--perplexity-data", help="a preprocessed dataset prefix")
    parser.add_argument("--perplexity-windows", type=int, default=16, help="windows scored")
    parser.add_argument(
        "--seq-length", type=int, help="longest input (default: the model's --seq-length)"
    )
    parser.add_argument(
        "--compare-untrained",
        action="store_true",
        help="also score the same model freshly initialised (--seed), as a baseline",
    )
    parser.add_argument("--seed", type=int, default=1234, help="the untrained model's seed")
    parser.add_argument("--output-json", help="write the results here too")
    parser.add_argument("--watch", action="store_true", help="score each new checkpoint")
    parser.add_argument("--watch-poll", type=float, default=30.0, help="seconds between looks")
    parser.add_argument("--watch-timeout", type=float, default=3600.0,
                        help="stop after this many seconds without a new checkpoint")  # fmt: skip
    parser.add_argument("--watch-until-iteration", type=int, help="stop after scoring this one")
    parser.add_argument("--output-jsonl", help="--watch: one line of results per checkpoint")
    add_tokenizer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.tasks and not args.perplexity_data:
        raise ConfigError("nothing to evaluate: give --tasks FILE... and/or --perplexity-data")
    if args.num_fewshot < 0 or args.perplexity_windows < 1:
        raise ConfigError("--num-fewshot must be >= 0 and --perplexity-windows >= 1")
    from engine.eval.multiple_choice import read_task

    tasks = {path: read_task(path) for path in args.tasks}  # bad files fail before loading
    if args.watch:
        return _watch(args, tasks)
    _evaluate_checkpoint(args, tasks, args.iteration)
    return 0


def _evaluate_checkpoint(args, tasks: dict, iteration: int | None) -> dict:
    """Load --load (at `iteration`, default the latest), score it, print and return the
    results (and write --output-json)."""
    from engine.eval.loading import load_model, plain_tokenizer, recorded_packing, untrained_like

    override = tokenizer_config(args) if tokenizer_flags_given(args) else None
    model, tokenizer, shown = load_model(args.load, iteration, override)
    tokenizer = plain_tokenizer(tokenizer)
    packing = recorded_packing(args.load, iteration)
    length = args.seq_length or model.config.seq_length
    learned = model.config.position_embedding_type == "learned_absolute"
    if learned and length > model.config.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {length} is longer than the model's learned positions "
            f"({model.config.max_position_embeddings})"
        )
    print(f"evaluating {shown}:")
    if packing is not None:
        print(f"  as trained on packed documents: {_flags(packing)}")
    results = {"model": shown} | _evaluate(model, tokenizer, tasks, length, args, packing)
    if packing is not None:
        results["packing"] = dataclasses.asdict(packing)
    if args.compare_untrained:
        print(f"the same model untrained (seed {args.seed}):")
        fresh = untrained_like(model, args.seed)
        results["untrained"] = _evaluate(fresh, tokenizer, tasks, length, args, packing)
    if args.output_json:  # written whole or not at all
        partial = f"{args.output_json}.partial"
        with open(partial, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(partial, args.output_json)
    return results


def _watch(args, tasks: dict) -> int:
    """--watch (module docstring)."""
    if not os.path.isdir(args.load):
        raise ConfigError(f"--watch --load {args.load}: not a folder; give the run's --save folder")
    if args.watch_poll <= 0 or args.watch_timeout < 0:
        raise ConfigError("--watch-poll must be positive and --watch-timeout at least 0")
    done = set()  # (iteration, consumed samples): a rollback's run saves an iteration again
    if args.output_jsonl and os.path.exists(args.output_jsonl):
        with open(args.output_jsonl) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a stopped watch
                    continue
                done.add((record["iteration"], record.get("consumed_samples")))
    last_new = time.monotonic()
    while True:
        fresh = [key for key in _checkpoints(args.load) if key not in done]
        for iteration, consumed in fresh:
            try:
                results = _evaluate_checkpoint(args, tasks, iteration)
            except (CheckpointError, FileNotFoundError):
                print(f"iteration {iteration} went away before it was scored (pruned?); skipped")
                continue
            done.add((iteration, consumed))
            if args.output_jsonl:
                line = {"iteration": iteration, "consumed_samples": consumed} | _summary(results)
                with open(args.output_jsonl, "a") as f:
                    f.write(json.dumps(line) + "\n")
            if args.watch_until_iteration is not None and iteration >= args.watch_until_iteration:
                return 0
        if fresh:
            last_new = time.monotonic()
        elif time.monotonic() - last_new >= args.watch_timeout:
            print(f"no new checkpoint in {args.load} for {args.watch_timeout:g} s; stopping")
            return 0
        time.sleep(min(args.watch_poll, max(args.watch_timeout, 0.01)))


def _checkpoints(load: str) -> list[tuple[int, int | None]]:
    """(iteration, consumed samples) of each complete checkpoint of `load`, oldest first."""
    from engine.checkpoint.files import committed_iterations, iteration_dir, read_meta

    found = []
    for iteration in committed_iterations(load):
        try:
            found.append((iteration, read_meta(iteration_dir(load, iteration))["consumed_samples"]))
        except (CheckpointError, FileNotFoundError, KeyError):
            continue  # pruned while listed, or not ours
    return found


def _summary(results: dict) -> dict:
    """A checkpoint's results without the per-question details."""
    out = {"model": results["model"]}
    for path, found in results["tasks"].items():
        name = os.path.splitext(os.path.basename(path))[0]
        out |= {f"acc/{name}": found["acc"], f"acc_norm/{name}": found["acc_norm"]}
        gold = [item["loglikelihoods"][q] for item, q in zip(found["items"], found["golds"],
                                                              strict=True)]  # fmt: skip
        out[f"gold_ll/{name}"] = sum(gold) / len(gold)
    if "perplexity" in results:
        out["ppl"] = results["perplexity"]["ppl"]
    return out


def _flags(packing) -> str:
    names = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
    return " ".join(f"--{n.replace('_', '-')}" for n in names if getattr(packing, n))


def _evaluate(model, tokenizer, tasks: dict, length: int, args, packing=None) -> dict:
    """Perplexity and task scores of one model, printed as they come (`packing`: the training
    run's document flags, applied as it applied them)."""
    from engine.eval.loading import loglikelihood_of, token_logprobs
    from engine.eval.multiple_choice import score
    from engine.eval.perplexity import perplexity

    results: dict = {"tasks": {}}
    if args.perplexity_data:
        found = perplexity(
            token_logprobs, model, args.perplexity_data, length, args.perplexity_windows, packing
        )
        results["perplexity"] = found | {"data": args.perplexity_data}
        print(
            f"  perplexity on {args.perplexity_data}: {found['ppl']:.3f} "
            f"(nll {found['nll']:.4f} over {found['tokens']} tokens)"
        )
    prefix = tokenizer.bos if getattr(tokenizer, "bos", None) is not None else tokenizer.eod
    loglikelihood = loglikelihood_of(model, length, prefix, packing)
    for path, questions in tasks.items():
        found = score(
            loglikelihood,
            tokenizer,
            questions,
            args.num_fewshot,
            args.fewshot_seed,
            args.target_delimiter,
            args.fewshot_delimiter,
        )
        golds = [question.gold for question in questions]
        results["tasks"][path] = found | {"num_fewshot": args.num_fewshot, "golds": golds}
        print(
            f"  {os.path.basename(path)}: acc {found['acc']:.4f} | acc_norm "
            f"{found['acc_norm']:.4f} | {found['n']} questions, {args.num_fewshot}-shot"
        )
    return results


if __name__ == "__main__":
    run(main)
