"""Blend weights that change over training: `--data-mix-schedule FILE`.

The file (JSON, or YAML) lists phases, each starting at a fraction of the training samples
(`at: 0.8`, e.g. the last 20% on high-quality data) or at an iteration (`iteration: 4000`),
with weights by the names the datasets have in `--data-path` (`web:PREFIX`; a name left out
weighs 0):

    phases:
      - at: 0.8
        weights: {web: 0.2, code: 0.2, books: 0.6}

Before the first phase the `--data-path` weights hold. A fraction becomes the first iteration
that starts at or past that many samples, so every switch falls between two steps. Each
phase's samples are assigned to datasets by megatron-core's greedy blending rule with that
phase's weights, and each dataset's samples are taken in order across phases (none is seen
twice). Each dataset is built for the whole run's samples, whatever its weights (builder.py),
so its own order depends on the run's length but not on the schedule: a resumed run whose
phases not yet begun were changed still reads every sample already read where it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.data.indexed.helpers import build_blending_indices
from engine.data.mix.blended import Blend, normalize_weights
from engine.data.streaming.shards import is_parquet_path
from engine.errors import ConfigError
from engine.files.structured import read_yaml_or_json

FLAG = "--data-mix-schedule"


@dataclass(frozen=True)
class MixPhase:
    iteration: int  # the first iteration of the phase (0-based: the step after this many)
    first_sample: int  # global samples consumed before it
    weights: tuple[float, ...]  # normalised, one per dataset of the blend


@dataclass(frozen=True)
class MixSchedule:
    names: tuple[str, ...]
    phases: tuple[MixPhase, ...]  # the first starts at iteration 0
    scheduled: bool = False  # from --data-mix-schedule (else a blend's fixed weights)
    run_samples: int = 0  # the samples of the whole run (scheduled: each dataset's size)

    def phase_at(self, iteration: int) -> MixPhase:
        """The phase the step after `iteration` steps trains with."""
        return [p for p in self.phases if p.iteration <= iteration][-1]

    def record(self) -> dict:
        """The schedule as the checkpoint keeps it (and compares it on resume)."""
        phases = [
            {"iteration": p.iteration, "weights": dict(zip(self.names, p.weights, strict=False))}
            for p in self.phases
        ]
        return {"phases": phases, "scheduled": self.scheduled, "run_samples": self.run_samples}

    def blending_indices(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset of global sample i, its index within that dataset) for `size` samples."""
        which, nth = [], []
        taken = np.zeros(len(self.names), dtype=np.int64)
        ends = [p.first_sample for p in self.phases[1:]] + [size]
        for phase, end in zip(self.phases, ends, strict=False):
            count = max(0, min(end, size) - phase.first_sample)
            if count == 0:
                continue
            # (datasets of weight 0 left out: the greedy rule's ties would pick them)
            used = np.array([d for d, w in enumerate(phase.weights) if w > 0])
            local, n = build_blending_indices([phase.weights[d] for d in used], count)
            w = used[local.astype(np.int64)].astype(np.int16)
            n = n.astype(np.int64) + taken[w.astype(np.int64)]
            taken += np.bincount(w, minlength=len(self.names))
            which.append(w)
            nth.append(n)
        if not which:
            return np.empty(0, dtype=np.int16), np.empty(0, dtype=np.int64)
        return np.concatenate(which), np.concatenate(nth)

    def describe(self) -> str:
        lines = []
        for p in self.phases:
            mix = ", ".join(f"{n} {w:.3g}" for n, w in zip(self.names, p.weights, strict=False))
            lines.append(f"from iteration {p.iteration} (sample {p.first_sample}): {mix}")
        return "data mix: " + "; ".join(lines)


def train_mix(
    blend: Blend | None, schedule_file: str | None, train_iters: int, batches
) -> MixSchedule | None:
    """The mix of the train split's `blend` (engine/data/sources.py; None for mock data): the
    schedule of --data-mix-schedule `schedule_file`, the plain weights of a blend of several
    datasets, or None (one dataset, mock data)."""
    if blend is None:
        if schedule_file:
            raise ConfigError(f"{FLAG} needs a blend of named datasets in --data-path")
        return None
    if schedule_file is None:
        if len(blend.prefixes) < 2 or blend.weights is None:  # (alone: weighted by size)
            return None
        return plain_schedule(blend.names, blend.weights)
    if blend.weights is None:
        raise ConfigError(
            f"{FLAG} needs weight/prefix pairs in --data-path (0.7 web:A 0.3 code:B), not "
            "prefixes alone (one epoch of each)"
        )
    if any(is_parquet_path(p) for p in blend.prefixes):
        raise ConfigError(
            f"{FLAG} is not supported for Parquet streams yet; preprocess the data into "
            ".bin/.idx (tools/preprocess_data.py) to schedule its mix"
        )
    return read_mix_schedule(schedule_file, blend.names, blend.weights, train_iters, batches)


def plain_schedule(names, weights) -> MixSchedule:
    """The one phase of a blend whose weights do not change (its record for checkpoints)."""
    return MixSchedule(tuple(names), (MixPhase(0, 0, tuple(normalize_weights(weights))),))


def read_mix_schedule(path: str, names, base_weights, train_iters: int, batches) -> MixSchedule:
    """The schedule of the file at `path` for a blend of `names` (weights `base_weights` from
    --data-path) and a run of `train_iters` steps of `batches` (engine.config.batch_schedule)."""
    raw = read_yaml_or_json(path, FLAG)
    phases_raw = raw.get("phases") if isinstance(raw, dict) else None
    if not isinstance(phases_raw, list) or not phases_raw:
        raise ConfigError(
            f"{FLAG} {path}: no `phases` list; write `phases: [{{at: 0.8, weights: "
            "{name: weight, ...}}]`"
        )
    _, total = batches.sizes(train_iters)
    starts = [
        _start(path, k, entry, total, train_iters, batches) for k, entry in enumerate(phases_raw)
    ]
    for k in range(1, len(starts)):
        if starts[k] <= starts[k - 1]:
            raise ConfigError(
                f"{FLAG} {path}: phase {k + 1} starts at iteration {starts[k]}, not after "
                f"phase {k} (iteration {starts[k - 1]}); list the phases in order, apart"
            )
    if starts[-1] >= train_iters:
        raise ConfigError(
            f"{FLAG} {path}: phase {len(starts)} starts at iteration {starts[-1]}, when "
            f"training ({train_iters} iterations) is over; start it earlier"
        )
    phases = [] if starts[0] == 0 else [plain_schedule(names, base_weights).phases[0]]
    for k, (entry, start) in enumerate(zip(phases_raw, starts, strict=False)):
        weights = _weights(path, k, entry, names)
        phases.append(MixPhase(start, batches.sizes(start)[1], tuple(weights)))
    return MixSchedule(tuple(names), tuple(phases), scheduled=True, run_samples=total)


def check_resumed_schedule(saved: dict | None, now: dict | None, iteration: int):
    """ConfigError when a run with a mix schedule (then or now) resumes at `iteration` with
    other weights before it, or another length (which changes every dataset's order): the
    samples it consumed would not be the ones the schedule now says. Phases that have not
    begun may change. (`MixSchedule.record()`s; a checkpoint kept no record before mixes
    existed, and fixed-weight blends resume as Megatron-LM's do, unchecked.)"""
    if not isinstance(saved, dict) or now is None:
        return
    if not (saved.get("scheduled") or now["scheduled"]):
        return
    if saved.get("scheduled") != now["scheduled"]:
        had = "with" if saved.get("scheduled") else "without"
        raise ConfigError(
            f"{FLAG}: the checkpoint at iteration {iteration} was trained {had} a mix schedule, "
            "and adding or dropping one changes each dataset's order; resume as it was trained "
            "(a schedule can start with the weights of --data-path and change them later)"
        )
    if saved["run_samples"] != now["run_samples"]:
        raise ConfigError(
            f"{FLAG}: the checkpoint's run was {saved['run_samples']} samples long and this one "
            f"is {now['run_samples']}, which changes each dataset's order; keep --train-iters "
            "(or --train-samples) and the batch sizes as they were"
        )
    begun = _rounded([p for p in saved["phases"] if p["iteration"] < iteration])
    if begun != _rounded([p for p in now["phases"] if p["iteration"] < iteration]):
        text = "; ".join(
            f"from iteration {i}: " + ", ".join(f"{k} {v:.3g}" for k, v in w.items())
            for i, w in begun
        )
        raise ConfigError(
            f"{FLAG}: the blend weights before iteration {iteration} differ from those the "
            f"checkpoint trained with ({text}); keep them (--data-path weights, phases begun) "
            "and change only phases that start later"
        )


def _rounded(phases: list[dict]) -> list:
    return [
        (p["iteration"], {k: round(v, 12) for k, v in p["weights"].items() if v}) for p in phases
    ]


def _start(path, k, entry, total_samples: int, train_iters: int, batches) -> int:
    """The first iteration of phase k."""
    where = f"{FLAG} {path}: phase {k + 1}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is not a mapping; give `at` (or `iteration`) and `weights`")
    if ("at" in entry) == ("iteration" in entry):
        raise ConfigError(f"{where}: give one of `at` (fraction of training) or `iteration`")
    if "iteration" in entry:
        value = entry["iteration"]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < train_iters:
            raise ConfigError(
                f"{where}: iteration {value!r} is not a whole number in [0, {train_iters})"
            )
        return value
    at = entry["at"]
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 <= at < 1:
        raise ConfigError(f"{where}: at {at!r} is not a fraction of training in [0, 1)")
    target = math.ceil(at * total_samples - 1e-9)
    low, high = 0, train_iters  # the first iteration that has consumed at least `target`
    while low < high:
        middle = (low + high) // 2
        if batches.sizes(middle)[1] < target:
            low = middle + 1
        else:
            high = middle
    return low


def _weights(path, k, entry, names) -> list[float]:
    where = f"{FLAG} {path}: phase {k + 1}"
    given = entry.get("weights")
    if not isinstance(given, dict) or not given:
        raise ConfigError(f"{where}: `weights` is not a mapping of dataset names to weights")
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(
            f"{where}: {unknown[0]!r} is not a dataset of --data-path (its names: "
            f"{', '.join(names)}); name datasets as name:PREFIX there"
        )
    weights = []
    for name in names:
        value = given.get(name, 0.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}: the weight of {name} ({value!r}) is not a number >= 0")
        weights.append(float(value))
    if sum(weights) <= 0:
        raise ConfigError(f"{where}: the weights are all zero")
    return normalize_weights(weights)
