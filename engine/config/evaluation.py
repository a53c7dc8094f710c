"""Evaluation during and after training (`EvalConfig`): the valid and test splits' losses, the
sampled continuations of --eval-prompts and the multiple-choice tasks of --eval-tasks."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class EvalConfig:
    """When and how much the run evaluates."""

    eval_interval: int | None = option(
        None, "evaluate on the valid split every this many steps (default: only at the end)"
    )
    eval_iters: int = option(100, "global batches per evaluation")
    eval_global_batch_size: int | None = option(
        None, "samples per evaluation batch (default --global-batch-size, the final one)"
    )
    eval_micro_batch_size: int | None = option(
        None, "samples per evaluation micro-batch (default --micro-batch-size)"
    )
    eval_prompts: str | None = option(
        None,
        "a text file of prompts, one a line: at each evaluation of the valid split, print and "
        "log a greedy and a sampled continuation of each (under the run's own layout)",
    )
    eval_max_new_tokens: int = option(32, "--eval-prompts: tokens generated per continuation")
    eval_temperature: float = option(0.8, "--eval-prompts: the sampled continuation's temperature")
    eval_top_p: float = option(0.95, "--eval-prompts: the sampled continuation's nucleus mass")
    eval_tasks: list[str] = option(
        [],
        "multiple-choice task files (JSONL: context, choices, gold; as tools/evaluate.py "
        "reads them) scored during training under the run's own layout: acc and acc_norm "
        "logged beside the loss, every --eval-tasks-interval iterations and at the end",
        nargs="+",
    )
    eval_tasks_interval: int | None = option(
        None, "--eval-tasks: iterations between scorings (default: --eval-interval)"
    )

    def validate(self) -> None:
        if self.eval_max_new_tokens < 1 or self.eval_temperature <= 0:
            raise ConfigError("--eval-max-new-tokens must be >= 1 and --eval-temperature > 0")
        if not 0 < self.eval_top_p <= 1:
            raise ConfigError(f"--eval-top-p {self.eval_top_p} must be in (0, 1]")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError("--eval-interval must be at least 1")
        if self.eval_tasks_interval is not None and self.eval_tasks_interval < 1:
            raise ConfigError("--eval-tasks-interval must be at least 1")
        if self.eval_tasks_interval is not None and not self.eval_tasks:
            raise ConfigError("--eval-tasks-interval without --eval-tasks: give the task files")
        if self.eval_iters < 0:
            raise ConfigError("--eval-iters must be non-negative")
        for name in ("eval_global_batch_size", "eval_micro_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")

    def batch_sizes(self, global_batch: int, micro_batch: int) -> tuple[int, int]:
        """(global, micro) batch of an evaluation, given the training's final ones."""
        return (
            self.eval_global_batch_size or global_batch,
            self.eval_micro_batch_size or micro_batch,
        )
