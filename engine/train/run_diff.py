"""What differs between the runs that wrote two checkpoints (tools/diff_runs.py): their
configurations field by field, the flags their command lines named, their data files and their
code, from the record each checkpoint's meta.json holds (engine/train/run_record.py)."""

from __future__ import annotations

import os

from engine.checkpoint.files import find_latest, is_iteration_name, iteration_dir, read_meta
from engine.errors import CheckpointError


def record_of(path: str) -> dict:
    """The run record of a checkpoint: a --save folder (its latest) or one iter_N folder."""
    folder = path
    if not is_iteration_name(os.path.basename(os.path.normpath(path))):
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(f"{path}: no checkpoint; give a --save folder or an iter_N one")
        folder = iteration_dir(path, latest)
    meta = read_meta(folder)
    if "run" not in meta or not meta["run"]:
        raise CheckpointError(
            f"{folder} holds no run record (written by an earlier version of the engine)"
        )
    return meta["run"]


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            out |= _flatten(inner, f"{prefix}{key}.")
        return out
    return {prefix.rstrip("."): value}


def differences(first: dict, second: dict) -> list[tuple[str, object, object]]:
    """(key, first's value, second's) for every key whose values differ (absent: None)."""
    a, b = _flatten(first), _flatten(second)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
