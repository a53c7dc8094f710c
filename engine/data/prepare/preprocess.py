"""Raw text -> tokenized Megatron indexed datasets, in parallel worker processes.

The main process reads records in order and hands them out in batches to a pool of workers
that decode (JSON, UTF-8, keys) and tokenize; results are written in submission order, so the
output is byte-identical for any number of workers. At most `2 * workers` batches are in
flight, so memory stays bounded however large the input is.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from engine.config.tokenizer import TokenizerConfig
from engine.data.indexed.dataset import IndexedDatasetBuilder, optimal_dtype
from engine.data.prepare.readers import Record, decode_record, expand_inputs, iter_records
from engine.data.tokenizers import Tokenizer, build_tokenizer
from engine.data.tokenizers.gigatoken_encoder import CHOICES, GigatokenEncoder, gigatoken_encoder
from engine.errors import InputError
from parallel.errors import one_line

BATCH_RECORDS = 512
BATCH_BYTES = 1 << 20
# A worker is replaced by a fresh fork after this many batches (at most 16 MB of text), so that
# what tokenizers keep per process (gigatoken's cache of every distinct pre-token grows with the
# input) cannot grow with the input.
BATCHES_PER_WORKER = 16


@dataclass
class PreprocessStats:
    """What a preprocessing run did; printed as the final summary."""

    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    empty: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    skip_messages: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return (
            f"documents: {self.documents:,}  tokens: {self.tokens:,}  skipped (bad): "
            f"{self.skipped:,}  skipped (empty): {self.empty:,}  time: {self.seconds:.1f}s  "
            f"({rate:,.0f} tokens/s, {self.input_bytes / max(self.seconds, 1e-9) / 1e6:.1f} MB/s)"
        )


@dataclass
class _BatchResult:
    flat: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    records: int
    input_bytes: int
    skipped: int = 0
    empty: int = 0
    skip_messages: list[str] = field(default_factory=list)
    error: str | None = None


@functools.lru_cache(maxsize=2)
def _tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    return build_tokenizer(cfg)


@functools.lru_cache(maxsize=2)
def _fast_encoder(cfg: TokenizerConfig, tokenize_with: str) -> GigatokenEncoder | None:
    if tokenize_with == "tokenizer":
        return None
    return gigatoken_encoder(_tokenizer(cfg), required=tokenize_with == "gigatoken")


def encode_batch(
    records: list[Record],
    keys: list[str],
    tokenizer_cfg: TokenizerConfig,
    append_eod: bool,
    skip_bad: bool,
    tokenize_with: str = "tokenizer",
) -> _BatchResult:
    """Decode and tokenize a batch of records (runs in a worker process)."""
    tokenizer = _tokenizer(tokenizer_cfg)
    fast = _fast_encoder(tokenizer_cfg, tokenize_with)
    dtype = optimal_dtype(tokenizer.vocab_size)
    texts: dict[str, list[str]] = {k: [] for k in keys}
    wheres: list[str] = []
    result = _BatchResult({}, {}, len(records), sum(r.size for r in records))
    for record in records:
        try:
            decoded = decode_record(record, keys)
        except InputError as err:
            if not skip_bad:
                result.error = str(err)
                return result
            result.skipped += 1
            if len(result.skip_messages) < 5:
                result.skip_messages.append(str(err))
            continue
        wheres.append(record.where)
        for key in keys:
            texts[key].append(decoded[key])
    for key in keys:
        if fast is not None:
            try:
                flat, lengths = fast.encode_flat(texts[key])
            except (TypeError, UnicodeError, ValueError):  # lone surrogates
                result.error = _first_unreadable(tokenizer, texts[key], wheres, key)
                return result
            result.empty += int(np.count_nonzero(lengths == 0))
            result.flat[key], result.lengths[key] = _with_eod(
                flat, lengths[lengths > 0], tokenizer.eod if append_eod else None, dtype
            )
            continue
        try:
            encoded = [ids for ids in tokenizer.tokenize_batch(texts[key]) if ids]
        except (InputError, TypeError, UnicodeError):  # ids that are not ids, lone surrogates
            result.error = _first_unreadable(tokenizer, texts[key], wheres, key)
            return result
        result.empty += len(texts[key]) - len(encoded)
        if append_eod:
            for ids in encoded:
                ids.append(tokenizer.eod)
        lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
        flat = np.fromiter(
            itertools.chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum())
        )
        result.flat[key], result.lengths[key] = flat, lengths
    return result


def _with_eod(flat: np.ndarray, lengths: np.ndarray, eod: int | None, dtype):
    """Flat ids of non-empty documents, an EOD after each when `eod` is given."""
    if eod is None:
        return flat.astype(dtype, copy=False), lengths
    ends = np.cumsum(lengths)
    return np.insert(flat, ends, eod).astype(dtype, copy=False), lengths + 1


def _first_unreadable(tokenizer, texts: list[str], wheres: list[str], key: str) -> str:
    for text, where in zip(texts, wheres, strict=False):
        try:
            tokenizer.tokenize(text)
        except InputError as err:
            return f"{where}: {key}: {err}"
        except (TypeError, UnicodeError) as err:
            return f"{where}: {key}: text the tokenizer cannot encode ({one_line(err)})"
    return f"{wheres[0]}: {key}: the tokenizer could not read the batch"


def _batches(records: Iterable[Record]) -> Iterator[list[Record]]:
    batch: list[Record] = []
    size = 0
    for record in records:
        batch.append(record)
        size += record.size
        if len(batch) >= BATCH_RECORDS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron-LM's naming: <prefix>_<key>_document."""
    return f"{output_prefix}_{key}_document"


class _Progress:
    """tqdm bar on a terminal; a plain line every `log_interval` documents otherwise."""

    def __init__(self, total_bytes: int | None, log_interval: int, enabled: bool):
        from tqdm import tqdm

        self.start = time.perf_counter()
        self.log_interval = log_interval
        self.enabled = enabled
        self.next_log = log_interval
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            desc="preprocess",
            disable=None if enabled else True,
            file=sys.stderr,
        )

    def update(self, stats: PreprocessStats, new_bytes: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rates = (
            f"{stats.documents / elapsed:,.0f} docs/s, {stats.input_bytes / elapsed / 1e6:.1f} "
            f"MB/s, {stats.tokens / elapsed:,.0f} tokens/s"
        )
        if not self.bar.disable:
            self.bar.update(new_bytes)
            self.bar.set_postfix_str(rates, refresh=False)
        elif self.enabled and stats.documents >= self.next_log:
            print(f"processed {stats.documents:,} documents ({rates})", file=sys.stderr)
            while self.next_log <= stats.documents:
                self.next_log += self.log_interval

    def close(self) -> None:
        self.bar.close()


WORKERS_PER_CPU = 4  # beyond this, workers only wait for each other (and fork without end)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or Slurm's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _ignore_interrupts() -> None:
    """A worker's start: Ctrl-C is the main process's to handle (it stops the pool); the
    worker ends by the pool's terminate, SIGTERM, which must kill it outright (not the main
    process's handler, inherited through fork, that raises)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def stopped_by_sigterm():
    """SIGTERM (kill, a scheduler) ends the work as an exception would: the workers are
    stopped and the unfinished outputs removed, then the process exits 143."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def preprocess(
    inputs: str | list[str],
    output_prefix: str,
    tokenizer: TokenizerConfig | str,
    json_keys: list[str] | None = None,
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_records: bool = False,
    log_interval: int = 10000,
    progress: bool = True,
    tokenize_with: str = "tokenizer",
    allow_empty: bool = False,
    in_process: bool = False,
) -> PreprocessStats:
    """Tokenize every document of `inputs` into `<output_prefix>_<key>_document.{bin,idx}`.

    `tokenizer` is the tokenizer's config, or the path of a SentencePiece model.
    `tokenize_with`: "tokenizer" (the default) uses the tokenizer's own library, exactly;
    "auto" encodes with gigatoken where it is installed and gives the tokenizer's ids on probe
    texts (engine/data/tokenizers/gigatoken_encoder.py; faster, but probes cannot prove
    equality: a rare document can come out different), "gigatoken" insists on it.

    On an error nothing is left at the output paths (earlier files there stay untouched);
    the InputError names the file and line or row. Input without a single document with text
    is refused rather than written as an empty dataset (`allow_empty`: nothing is written and
    the counts say so, for a task of a distributed run tokenizing one file of many;
    `in_process`: no worker processes, as such a task runs inside an executor's worker).
    """
    keys = list(json_keys or ["text"])
    if workers < 1:
        raise InputError(f"--workers {workers}: need at least 1")
    most = WORKERS_PER_CPU * available_cpus()
    if workers > most:
        raise InputError(
            f"--workers {workers}: this process may use {available_cpus()} CPUs; give at most "
            f"{most} (more workers only wait for each other)"
        )
    if log_interval < 1:
        raise InputError(f"--log-interval {log_interval}: need at least 1 document")
    files = expand_inputs(inputs)
    # Loaded before the workers fork, so each inherits it instead of loading its own copy.
    if not isinstance(tokenizer, TokenizerConfig):
        tokenizer = TokenizerConfig(tokenizer_model=os.fspath(tokenizer))
    tokenizer_cfg = tokenizer
    tokenizer = _tokenizer(tokenizer_cfg)
    if tokenize_with not in CHOICES:
        raise InputError(f"--tokenize-with {tokenize_with}: choose one of {', '.join(CHOICES)}")
    _fast_encoder(tokenizer_cfg, tokenize_with)  # verified once here, before the workers fork
    dtype = optimal_dtype(tokenizer.vocab_size)
    compressed = any(f.endswith((".gz", ".zst")) for f in files)
    total_bytes = None if compressed else sum(os.path.getsize(f) for f in files)
    stats = PreprocessStats()
    file_stats: dict = {}
    builders: dict[str, IndexedDatasetBuilder] = {}
    progress_bar = _Progress(total_bytes, log_interval, progress)
    start = time.perf_counter()
    work = functools.partial(
        encode_batch,
        keys=keys,
        tokenizer_cfg=tokenizer_cfg,
        append_eod=append_eod,
        skip_bad=skip_bad_records,
        tokenize_with=tokenize_with,
    )
    # Workers start from the clean single-threaded forkserver, not forked from this process:
    # a child forked from a process with threads (a progress bar's monitor, a test runner's)
    # can block on a lock copied mid-use before its initializer resets SIGTERM, and then the
    # pool's terminate after a bad record waits on it forever (seen under load in CI).
    context = multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")
    try:
        # Opening the outputs first finds an unwritable --output-prefix before any work.
        for key in keys:
            builders[key] = IndexedDatasetBuilder(output_prefix_for(output_prefix, key), dtype)
        records = iter_records(files, keys, skip_bad_records, file_stats)
        if in_process:
            for batch in _batches(records):
                _consume(work(batch), builders, stats, progress_bar)
        else:
            _in_pool(context, workers, work, records, builders, stats, progress_bar)
        stats.skipped += file_stats.get("skipped", 0)
        stats.skip_messages.extend(file_stats.get("skip_messages", []))
        if stats.documents == 0:  # an empty dataset must not replace an earlier one
            if not allow_empty:
                raise InputError(no_documents_message(files, stats))
            for builder in builders.values():
                builder.abort()
            builders = {}
        # Every output is written in full before any replaces what was there.
        for builder in builders.values():
            builder.prepare()
        for builder in builders.values():
            builder.commit()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        progress_bar.close()
    stats.seconds = time.perf_counter() - start
    stats.outputs = [output_prefix_for(output_prefix, k) for k in keys]
    return stats


def _in_pool(context, workers: int, work, records, builders, stats, progress_bar) -> None:
    """Batches encoded in `workers` processes, consumed in order, 2 per worker in flight."""
    with (
        stopped_by_sigterm(),
        context.Pool(
            workers, initializer=_ignore_interrupts, maxtasksperchild=BATCHES_PER_WORKER
        ) as pool,
    ):
        pending: deque = deque()
        for batch in _batches(records):
            pending.append(pool.apply_async(work, (batch,)))
            if len(pending) >= 2 * workers:
                _consume(pending.popleft().get(), builders, stats, progress_bar)
        while pending:
            _consume(pending.popleft().get(), builders, stats, progress_bar)


def no_documents_message(files: list[str], stats: PreprocessStats) -> str:
    where = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"
    if stats.empty or stats.skipped:
        found = f"{stats.empty:,} empty, {stats.skipped:,} bad and skipped"
    else:
        found = "the input holds no records"
    return (
        f"{where}: no documents with text ({found}), so no dataset was written; check --input "
        "and --json-keys"
    )


def _consume(result: _BatchResult, builders, stats: PreprocessStats, progress: _Progress) -> None:
    if result.error is not None:
        raise InputError(result.error)
    key = next(iter(builders))
    for name, builder in builders.items():
        builder.add_sequences(result.flat[name], result.lengths[name])
    stats.documents += len(result.lengths[key])
    stats.tokens += int(sum(int(result.lengths[k].sum()) for k in builders))
    stats.skipped += result.skipped
    stats.empty += result.empty
    stats.input_bytes += result.input_bytes
    if len(stats.skip_messages) < 5:
        stats.skip_messages.extend(result.skip_messages[: 5 - len(stats.skip_messages)])
    progress.update(stats, result.input_bytes)
