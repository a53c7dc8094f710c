"""The range of token ids of an indexed dataset, checked against the model's vocabulary at start
(and its document boundaries against its end-of-document tokens).

A dataset made with another tokenizer (or by Megatron-LM's legacy tokenizers, whose EOD id can
lie past a SentencePiece vocabulary) would otherwise index past the embedding: an IndexError
deep in the model on one rank, or silently infinite losses under tensor parallelism. The token
dtype bounds the ids for free (uint16 ids are below 65,536); otherwise the `.bin` is scanned
once and the result cached beside the dataset's other index caches, keyed by the size and
modification time of its files, so later starts read one small JSON file. Processes starting
together (the ranks of a job) take a lock so that one scans and the others read its result.
The smallest id is checked too (int32 data can hold negative ids).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os

import numpy as np

from engine.data.indexed.dataset import IndexedDataset, data_file, index_file
from engine.errors import ConfigError

_SCAN_ELEMENTS = 1 << 26
log = logging.getLogger(__name__)


def _identity(prefix: str) -> dict:
    out = {}
    for kind, path in (("bin", data_file(prefix)), ("idx", index_file(prefix))):
        stat = os.stat(path)
        out[f"{kind}_bytes"], out[f"{kind}_mtime_ns"] = stat.st_size, stat.st_mtime_ns
    return out


def _scan(dataset: IndexedDataset) -> tuple[int, int]:
    """(min, max) over every token of the .bin ((0, -1) when it holds none), in chunks."""
    tokens = np.frombuffer(dataset._bin_buffer, dtype=dataset.dtype) if dataset.num_tokens else []
    chunks = [tokens[i : i + _SCAN_ELEMENTS] for i in range(0, len(tokens), _SCAN_ELEMENTS)]
    if not chunks:
        return 0, -1
    return min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)


def _cached(path: str, identity: dict) -> tuple[int, int] | None:
    try:
        with open(path) as f:
            cached = json.load(f)
        if {k: cached.get(k) for k in identity} == identity:
            return int(cached["min_token_id"]), int(cached["max_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def token_id_range(dataset: IndexedDataset, cache_dir: str | None = None) -> tuple[int, int]:
    """(smallest, largest) token id in the dataset, from its cache when the files are
    unchanged; scanned (and cached where the cache folder can be written) otherwise."""
    prefix = os.path.abspath(dataset.prefix)
    directory = cache_dir or os.path.join(os.path.dirname(prefix), "cache")
    where = hashlib.md5(prefix.encode()).hexdigest()[:12]  # same names in other folders
    path = os.path.join(directory, f"{os.path.basename(prefix)}-{where}-token_ids.json")
    identity = _identity(prefix)
    found = _cached(path, identity)
    if found is not None:
        return found
    try:
        os.makedirs(directory, exist_ok=True)
        lock = open(path + ".lock", "w")  # noqa: SIM115 - held until the scan is cached
    except OSError as err:
        log.warning(
            "cannot cache the token-id range of %s in %s (%s): every start scans the data; "
            "give --data-cache-path a writable folder",
            prefix,
            directory,
            err.strerror,
        )
        return _scan(dataset)
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process scans, the others read its result
        except OSError:  # a file system without locks: each process scans
            pass
        found = _cached(path, identity)
        if found is not None:
            return found
        found = _scan(dataset)
        try:
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(dict(identity, min_token_id=found[0], max_token_id=found[1]), f)
            os.replace(tmp, path)
        except OSError:
            pass
        return found


def check_token_ids(
    dataset: IndexedDataset, vocab_size: int, vocab_source: str, cache_dir: str | None = None
) -> None:
    """ConfigError when the dataset holds a token id the vocabulary of `vocab_size` lacks.
    `vocab_source` names where that size comes from (the tokenizer, or --vocab-size)."""
    limits = np.iinfo(dataset.dtype)
    if limits.min >= 0 and limits.max < vocab_size:
        return  # the token dtype cannot hold an id outside the vocabulary
    smallest, largest = token_id_range(dataset, cache_dir)
    if smallest < 0:
        raise ConfigError(
            f"{data_file(dataset.prefix)} holds the negative token id {smallest}; the dataset "
            "is damaged or was not written by a tokenizer"
        )
    if largest >= vocab_size:
        raise ConfigError(
            f"{data_file(dataset.prefix)} holds token id {largest}, but {vocab_source} has a "
            f"vocabulary of {vocab_size} (ids 0..{vocab_size - 1}); use the tokenizer the "
            "data was made with, or preprocess the data again with this one"
        )


def check_document_boundaries(dataset: IndexedDataset, eod: int, documents: int = 64) -> None:
    """ConfigError when the `.idx` does not describe the `.bin`: data preprocessed with
    --append-eod ends each document with EOD, so when the first documents mostly do not end
    with it but hold it inside, the boundaries are another dataset's (an `.idx` of the same
    size copied from elsewhere). Data without EOD tokens passes."""
    count = min(dataset.num_documents, documents)
    ends_with, holds_inside = 0, 0
    for k in range(count):
        tokens = dataset[k]
        if len(tokens) and int(tokens[-1]) == eod:
            ends_with += 1
        if len(tokens) > 1 and bool((tokens[:-1] == eod).any()):
            holds_inside += 1
    if count and ends_with <= count // 4 and holds_inside >= max(1, count // 4):
        raise ConfigError(
            f"{index_file(dataset.prefix)} does not describe {data_file(dataset.prefix)}: "
            f"{holds_inside} of its first {count} documents hold the end-of-document token "
            f"(id {eod}) inside them and only {ends_with} end with it; use the .idx written "
            "with this .bin (preprocess again)"
        )
