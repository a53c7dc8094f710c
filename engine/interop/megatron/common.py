"""The common (not sharded) state of a Megatron-LM torch_dist checkpoint, read without running
code: its saved arguments, iteration, learning-rate schedule and optimizer step.

Where it lives: megatron-core up to 0.16 writes it to `common.pt`; later versions store it
inside the checkpoint as the sharded object `common_state` (a torch.save'd one-item list in
the .distcp files) and write no common.pt. Both are read with torch's weights-only loader and
an exact allow-list:

- argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath and signal.Signals, as they are
  (plain data; Megatron-LM's arguments hold them, --exit-signal for one);
- the megatron-core classes Megatron-LM's own loader allows (megatron/core/safe_globals.py):
  its enums (--attention-backend, the model type, CUDA-graph scopes, rerun modes) and
  dataclasses (OptimizerConfig, RerunState). They are not imported: `ForeignValue` stands in
  for each and keeps what was saved, so a checkpoint loads here without megatron installed and
  nothing of megatron's runs.

Anything else the state names is refused in one line, before anything is unpickled.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import signal
import types

import torch

from engine.errors import InputError
from parallel.checkpoint.dcp import SafeFileSystemReader
from parallel.errors import CheckpointError, one_line


class ForeignValue:
    """A value of a megatron-core class (an enum member or a dataclass) as saved: the enum's
    value in `args`, the dataclass's fields in `state`. Never calls megatron code."""

    def __init__(self, *args):
        self.args, self.state = args, None

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"ForeignValue{self.args or self.state!r}"


_PLAIN = (argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals)
_MEGATRON = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)
COMMON_STATE_KEY = "common_state"


def _name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _allowed() -> list:
    return list(_PLAIN) + [(ForeignValue, name) for name in _MEGATRON]


def load_common_bytes(data: bytes, where: str):
    """torch.load of `data` (the file or entry `where`), weights-only with the allow-list."""
    allowed = {_name(c) for c in _PLAIN} | set(_MEGATRON)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception as err:  # noqa: BLE001 - a damaged file
        raise InputError(f"{where}: not a readable torch file ({one_line(err)})") from None
    refused = sorted(set(unsafe) - allowed)
    if refused:
        raise InputError(
            f"{where}: refers to {refused[0]}, outside what a Megatron-LM checkpoint's common "
            "state holds here (its arguments, enums and configs); refusing to load it "
            "(nothing was run)"
        )
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - damaged, or refused by the weights-only loader
        raise InputError(f"{where}: cannot be read weights-only ({one_line(err)})") from None


def _inside_checkpoint(
    path: str, name: str = COMMON_STATE_KEY, metadata=None
) -> tuple[bytes, str] | None:
    """The bytes of megatron-core's sharded object `name` (the `common_state` by default) in
    the checkpoint's .distcp files, or None. `metadata`: the checkpoint's, already read."""
    if metadata is None:
        reader = SafeFileSystemReader(path)
        reader.foreign = True
        try:
            metadata = reader.read_metadata()
        except CheckpointError as err:
            raise InputError(str(err)) from None
    for fqn, info in getattr(metadata, "dropped_objects", {}).items():
        if fqn.split("/")[0] != name:
            continue
        where = os.path.join(path, info.relative_path)
        try:
            with open(where, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as err:
            raise InputError(f"{where}: cannot read {fqn} ({err.strerror or err})") from None
        if len(data) != info.length:
            raise InputError(f"{where}: {fqn} is cut short; the checkpoint is damaged")
        return data, f"{where} ({fqn})"
    return None


def read_common(path: str) -> dict:
    """The common state of the iteration folder `path` (common.pt, else the `common_state`
    entry); {} when it has neither."""
    file = os.path.join(path, "common.pt")
    if os.path.exists(file):
        try:
            with open(file, "rb") as f:
                common, where = load_common_bytes(f.read(), file), file
        except OSError as err:
            raise InputError(f"{file}: cannot be read ({err.strerror or err})") from None
    else:
        common, where = read_object(path, COMMON_STATE_KEY), f"{path} ({COMMON_STATE_KEY})"
        if common is None:
            return {}
    if not isinstance(common, dict):
        raise InputError(f"{where}: holds a {type(common).__name__}, not Megatron-LM's state")
    return common


def read_object(path: str, name: str, metadata=None):
    """megatron-core's sharded object `name` in the iteration folder `path` (plain data, read
    weights-only with the allow-list), or None when the checkpoint holds no such object.
    `metadata`: the checkpoint's, already read."""
    found = _inside_checkpoint(path, name, metadata)
    if found is None:
        return None
    value = load_common_bytes(*found)
    # megatron-core saves each object as a one-item list
    return value[0] if isinstance(value, list) and len(value) == 1 else value
