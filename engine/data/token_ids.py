"""The largest token id of an indexed dataset, checked against the model's vocabulary at start.

A dataset made with another tokenizer (or by Megatron-LM's legacy tokenizers, whose EOD id can
lie past a SentencePiece vocabulary) would otherwise index past the embedding: an IndexError
deep in the model on one rank, or silently infinite losses under tensor parallelism. The token
dtype bounds the ids for free (uint16 ids are below 65,536); otherwise the `.bin` is scanned
once and the result cached beside the dataset's other index caches, keyed by the size and
modification time of its files, so later starts read one small JSON file. Processes starting
together (the ranks of a job) take a lock so that one scans and the others read its result.
"""

from __future__ import annotations

import fcntl
import json
import os

import numpy as np

from engine.data.indexed import IndexedDataset, data_file, index_file
from engine.errors import ConfigError

_SCAN_ELEMENTS = 1 << 26


def _identity(prefix: str) -> dict:
    out = {}
    for kind, path in (("bin", data_file(prefix)), ("idx", index_file(prefix))):
        stat = os.stat(path)
        out[f"{kind}_bytes"], out[f"{kind}_mtime_ns"] = stat.st_size, stat.st_mtime_ns
    return out


def _scan(dataset: IndexedDataset) -> int:
    """max over every token of the .bin (-1 when it holds none), in bounded chunks."""
    tokens = np.frombuffer(dataset._bin_buffer, dtype=dataset.dtype) if dataset.num_tokens else []
    largest = -1
    for start in range(0, len(tokens), _SCAN_ELEMENTS):
        largest = max(largest, int(tokens[start : start + _SCAN_ELEMENTS].max()))
    return largest


def max_token_id(dataset: IndexedDataset, cache_dir: str | None = None) -> int:
    """The largest token id in the dataset, from its cache when the files are unchanged."""
    prefix = dataset.prefix
    directory = cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")
    path = os.path.join(directory, f"{os.path.basename(prefix)}-max_token_id.json")
    identity = _identity(prefix)
    try:
        os.makedirs(directory, exist_ok=True)
        lock = open(path + ".lock", "w")  # noqa: SIM115 - held until the scan is cached
    except OSError:  # a read-only data folder: scan without caching
        return _scan(dataset)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                cached = json.load(f)
            if {k: cached.get(k) for k in identity} == identity:
                return int(cached["max_token_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        largest = _scan(dataset)
        try:
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(dict(identity, max_token_id=largest), f)
            os.replace(tmp, path)
        except OSError:
            pass
        return largest


def check_token_ids(
    prefixes: list[str], vocab_size: int, vocab_source: str, cache_dir: str | None = None
) -> None:
    """ConfigError when a dataset holds a token id the vocabulary of `vocab_size` lacks.
    `vocab_source` names where that size comes from (the tokenizer, or --vocab-size)."""
    for prefix in prefixes:
        dataset = IndexedDataset(prefix)
        try:
            if np.iinfo(dataset.dtype).max < vocab_size:
                continue  # the token dtype cannot hold an id past the vocabulary
            largest = max_token_id(dataset, cache_dir)
        finally:
            dataset.close()
        if largest >= vocab_size:
            raise ConfigError(
                f"{data_file(prefix)} holds token id {largest}, but {vocab_source} has a "
                f"vocabulary of {vocab_size} (ids 0..{vocab_size - 1}); use the tokenizer the "
                "data was made with, or preprocess the data again with this one"
            )
