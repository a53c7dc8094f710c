"""Where the corpus-wide steps find the documents step 1 kept: every part folder of every
shard, in order, and each survivor's global number (its position in that order; its lines'
likewise). Any task computes the same layout from the part records step 1 wrote, so tasks on
other machines agree on the numbers without talking to each other.

Sets of document or line numbers pass between tasks as sorted .npy files, read with a memory
map and cut to a part's range by binary search: a task holds the numbers of the part it is on,
not of the corpus.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from engine.curation.atomic import save_npy

PARTS_FILE = "parts.json"  # per shard folder: [{"survivors": n, "lines": m}, ...]


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


@dataclass(frozen=True)
class Part:
    folder: str
    shard: int
    documents: int  # survivors of step 1
    lines: int  # their lines (0 when line deduplication is off)
    first_document: int  # global number of its first survivor
    first_line: int


def corpus_layout(work: str, shards: int) -> list[Part]:
    """Every part of every shard, in order, with its global numbers."""
    parts, document, line = [], 0, 0
    for k in range(shards):
        folder = os.path.join(work, shard_name(k))
        with open(os.path.join(folder, PARTS_FILE)) as f:
            records = json.load(f)
        for p, record in enumerate(records):
            parts.append(
                Part(os.path.join(folder, f"part-{p:05d}"), k, record["survivors"],
                     record["lines"], document, line)
            )  # fmt: skip
            document += record["survivors"]
            line += record["lines"]
    return parts


def save_ids(path: str, ids) -> None:
    """A set of global numbers, sorted, written whole or not at all."""
    save_npy(path, np.sort(np.asarray(ids, dtype=np.int64)))


class SortedIds:
    """The union of sorted id files (memory-mapped), read range by range."""

    def __init__(self, paths: list[str]):
        self.arrays = [np.load(p, mmap_mode="r") for p in paths]

    def within(self, start: int, stop: int) -> np.ndarray:
        """The ids in [start, stop), sorted, minus `start`."""
        pieces = []
        for array in self.arrays:
            lo, hi = np.searchsorted(array, [start, stop])
            pieces.append(np.asarray(array[lo:hi]) - start)
        return np.sort(np.concatenate(pieces)) if pieces else np.empty(0, np.int64)
