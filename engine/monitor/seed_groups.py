"""Runs repeated over seeds (tools/plot_metrics.py's bands): the runs whose configurations
differ only in --seed and where their outputs go form a group, and a group's losses are read as
mean +- standard deviation over its runs. The configuration is the one each run writes beside
its log (engine/monitor/run_log.py); a run without one is a group of its own."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from engine.monitor.run_log import description_path

# (section, field) that may differ between repeats of one experiment: the seed, and where the
# run writes (logs, checkpoints, heartbeats)
NOT_THE_EXPERIMENT = frozenset({
    ("training", "seed"),
    ("logging", "log_jsonl"), ("logging", "tensorboard_dir"), ("logging", "wandb_exp_name"),
    ("logging", "wandb_save_dir"),
    ("checkpointing", "save"), ("checkpointing", "load"),
    ("resilience", "heartbeat_dir"),
})  # fmt: skip


@dataclass(frozen=True)
class SeedGroup:
    paths: tuple[str, ...]  # the runs' --log-jsonl files
    seeds: tuple[int | None, ...]


def _experiment(jsonl: str) -> str | None:
    """The configuration without what repeats may change, as text; None without one."""
    path = description_path(jsonl)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        configuration = json.load(f).get("configuration")
    if not configuration:
        return None
    kept = {
        section: {k: v for k, v in fields.items() if (section, k) not in NOT_THE_EXPERIMENT}
        for section, fields in configuration.items()
        if section != "given"
    }
    return json.dumps(kept, sort_keys=True)


def _seed(jsonl: str) -> int | None:
    path = description_path(jsonl)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("seed")


def group_by_seed(paths: list[str]) -> list[SeedGroup]:
    """The runs grouped, in the order each group's first run is given."""
    groups: dict[object, list[str]] = {}
    for index, path in enumerate(paths):
        key = _experiment(path)
        groups.setdefault(key if key is not None else ("alone", index), []).append(path)
    return [SeedGroup(tuple(p), tuple(_seed(x) for x in p)) for p in groups.values()]


def mean_and_std(series: list[tuple[list, list]]) -> tuple[list, list, list]:
    """(x, mean, sample standard deviation) at the x values every run logged."""
    common = set(series[0][0])
    for xs, _ in series[1:]:
        common &= set(xs)
    x = sorted(common)
    values = np.array([[dict(zip(xs, ys, strict=True))[i] for i in x] for xs, ys in series])
    std = values.std(axis=0, ddof=1) if len(series) > 1 else np.zeros(len(x))
    return x, values.mean(axis=0).tolist(), std.tolist()


def final_text(values: list[float]) -> str:
    """`mean +- std (n runs)` of the runs' final values."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "no finite value"
    std = float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0
    return f"{float(np.mean(finite)):.4f} +- {std:.4f} ({len(finite)} runs)"
