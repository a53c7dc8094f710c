"""A run's log as the tools read it: the records of its --log-jsonl file and the description
the run writes beside it (`<name>.run.json` for `<name>.jsonl`: the parameter count, the
training FLOPs per token, the sequence length, the seed and the whole configuration), which
tools/fit_scaling.py and tools/plot_metrics.py's seed bands read."""

from __future__ import annotations

import json
import os

from engine.errors import InputError


def description_path(jsonl: str) -> str:
    """`metrics.jsonl` -> `metrics.run.json` (any other name: the name + `.run.json`)."""
    stem = jsonl[: -len(".jsonl")] if jsonl.endswith(".jsonl") else jsonl
    return stem + ".run.json"


def write_description(jsonl: str, description: dict) -> None:
    """Atomically, so that a reader never sees half of it."""
    path = description_path(jsonl)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(description, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_description(jsonl: str) -> dict:
    path = description_path(jsonl)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputError(
            f"{path}: no run description beside {jsonl} (the engine writes it at the start of "
            "a run with --log-jsonl since this version); rerun, or leave the run out"
        ) from None
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None


def read_log(path: str) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a --log-jsonl file."""
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
                if "samples" in record:  # generation samples (--eval-prompts): text
                    continue
                (evals if "split" in record else train).append(record)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; pass the run's --log-jsonl file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: a folder; pass the run's --log-jsonl file") from None
    if not train:
        raise InputError(f"{path}: no training records")
    return train, evals


def logs_under(folder: str) -> list[str]:
    """The --log-jsonl files under `folder` (any depth) that have a run description."""
    found = []
    for path, _, names in os.walk(folder):
        found += [
            os.path.join(path, n)
            for n in names
            if n.endswith(".jsonl") and os.path.exists(description_path(os.path.join(path, n)))
        ]
    return sorted(found)
