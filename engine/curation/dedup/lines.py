"""Corpus-wide removal of duplicate lines (CCNet's, used by LLaMA), then each part's decisions:

    lines (task r of R)   the non-blank lines of documents still kept whose hash falls in
                          partition r: every copy after the first in corpus order is dropped
                          -> lines-r.npy (global line numbers)
    decide (per shard)    each part's decisions.npz: per survivor a code (1 an exact copy,
                          3 a near duplicate, 2 every non-blank line dropped) and per line
                          whether it is dropped

Lines run after the documents' deduplication, so that a line's kept copy is never in a
removed document.
"""

from __future__ import annotations

import os

import numpy as np

from engine.curation.atomic import save_npz
from engine.curation.dedup.documents import DEDUP_FOLDER
from engine.curation.dedup.layout import Part, SortedIds, save_ids

EXACT, LINES, NEAR = 1, 2, 3  # decision codes (0: kept)


def lines_path(work: str, r: int) -> str:
    return os.path.join(work, DEDUP_FOLDER, f"lines-{r:05d}.npy")


def _removed_documents(part: Part, removed: SortedIds) -> np.ndarray:
    """Per survivor of the part, whether the documents' deduplication removed it."""
    gone = np.zeros(part.documents, bool)
    gone[removed.within(part.first_document, part.first_document + part.documents)] = True
    return gone


def _part_lines(part: Part):
    with np.load(os.path.join(part.folder, "hashes.npz")) as f:
        return f["line"], f["lines_per_document"], f["blank"]


def lines_task(work: str, parts: list[Part], r: int, partitions: int, removed_files) -> None:
    removed = SortedIds(removed_files)
    hashes, numbers = [], []
    for part in parts:
        if not part.lines:
            continue
        line, per_document, blank = _part_lines(part)
        owner = np.repeat(np.arange(part.documents), per_document)
        alive = ~_removed_documents(part, removed)[owner] & ~blank
        mine = np.flatnonzero(alive & (line % np.uint64(partitions) == r))
        hashes.append(line[mine])
        numbers.append(mine + part.first_line)
    hashes = np.concatenate(hashes or [np.empty(0, np.uint64)])
    numbers = np.concatenate(numbers or [np.empty(0, np.int64)])
    _, first = np.unique(hashes, return_index=True)  # the first copy, in corpus order
    dropped = np.ones(len(numbers), bool)
    dropped[first] = False
    save_ids(lines_path(work, r), numbers[dropped])


def decide_part(part: Part, exact: SortedIds, near: SortedIds, lines: SortedIds | None) -> None:
    """The part's decisions.npz (written whole or not at all)."""
    start, stop = part.first_document, part.first_document + part.documents
    code = np.zeros(part.documents, np.int8)
    code[exact.within(start, stop)] = EXACT
    code[near.within(start, stop)] = NEAR
    drop = np.zeros(part.lines, bool)
    if lines is not None and part.lines:
        drop[lines.within(part.first_line, part.first_line + part.lines)] = True
        _, per_document, blank = _part_lines(part)
        owner = np.repeat(np.arange(part.documents), per_document)
        alive = (code[owner] == 0) & ~blank
        left = np.bincount(owner[alive & ~drop], minlength=part.documents)
        has_lines = np.bincount(owner[alive], minlength=part.documents) > 0
        code[(code == 0) & has_lines & (left == 0)] = LINES
    path = os.path.join(part.folder, "decisions.npz")
    save_npz(path, code=code, drop=drop)
