"""Reading the tensors of one of our checkpoints whole, for tests that compare them."""

from __future__ import annotations

import torch

from engine.checkpoint.files import iteration_dir
from engine.checkpoint.load import open_checkpoint, read_tensors


def checkpoint_tensors(root: str, iteration: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` (its key's start) of iteration `iteration` of the checkpoint
    folder `root`, whole, read in one pass."""
    path = iteration_dir(root, iteration)
    reader = open_checkpoint(path)
    wanted = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    read_tensors(path, wanted, reader=reader)
    return wanted
