"""The points a scaling-law fit reads from runs (tools/fit_scaling.py): each run's logged
training losses against the compute spent so far, and its final loss with its parameters and
tokens. Compute is the engine's own count (training FLOPs per token, engine/monitor/metrics.py,
times the tokens consumed), read from the description each run writes beside its log
(engine/monitor/run_log.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from engine.errors import InputError
from engine.monitor.run_log import logs_under, read_description, read_log


@dataclass(frozen=True)
class RunPoints:
    name: str
    parameters: int
    flops_per_token: float
    tokens: np.ndarray  # at each training log record
    loss: np.ndarray  # the training loss of each record (its log window's mean)
    final_loss: float  # the last validation loss, else the last training record's
    final_tokens: float

    @property
    def compute(self) -> np.ndarray:
        return self.flops_per_token * self.tokens

    @property
    def final_compute(self) -> float:
        return self.flops_per_token * self.final_tokens


def run_points(jsonl: str) -> RunPoints:
    description = read_description(jsonl)
    train, evals = read_log(jsonl)
    seq = description["seq_length"]
    kept = [r for r in train if r.get("lm_loss") is not None]
    if not kept:
        raise InputError(f"{jsonl}: no finite training loss logged")
    tokens = np.array([r["consumed_samples"] * seq for r in kept], dtype=float)
    loss = np.array([r["lm_loss"] for r in kept], dtype=float)
    valid = [r for r in evals if r.get("split") == "valid" and r.get("lm_loss") is not None]
    final_loss = valid[-1]["lm_loss"] if valid else float(loss[-1])
    final_tokens = valid[-1]["consumed_samples"] * seq if valid else float(tokens[-1])
    name = os.path.basename(os.path.dirname(os.path.abspath(jsonl))) or jsonl
    return RunPoints(
        name, description["parameters"], description["flops_per_token"], tokens, loss,
        float(final_loss), float(final_tokens),
    )  # fmt: skip


def read_runs(paths: list[str]) -> list[RunPoints]:
    """The runs of `paths`: --log-jsonl files, or folders searched for them (a sweep)."""
    logs = []
    for path in paths:
        if os.path.isdir(path):
            found = logs_under(path)
            if not found:
                raise InputError(
                    f"{path}: no run logs found (a *.jsonl file with its *.run.json beside it); "
                    "give the runs' --log-jsonl files or the folder holding them"
                )
            logs += found
        elif not os.path.exists(path):
            raise InputError(f"{path}: no such file or folder; give --log-jsonl files or folders")
        else:
            logs.append(path)
    return [run_points(p) for p in logs]


def frontier_points(runs: list[RunPoints], skip_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(compute, loss) of every run's records past the first `skip_fraction` of its tokens
    (early training is not on a power law)."""
    compute, loss = [], []
    for run in runs:
        kept = run.tokens > skip_fraction * run.tokens[-1]
        compute.append(run.compute[kept])
        loss.append(run.loss[kept])
    return np.concatenate(compute), np.concatenate(loss)
