"""Training straight from Parquet: documents tokenized on the fly and packed into samples.

The order is defined by windows, so that it depends on nothing but the data and the seed:
  - each epoch visits a source's shards in an order drawn from (seed, split, epoch);
  - each shard is cut into windows of --parquet-shuffle-buffer consecutive rows; a split takes
    its --split share of every window's rows (train first, then valid, then test);
  - a window's documents are tokenized (EOD after each), concatenated and cut into samples of
    seq_length + 1 tokens, consecutive samples sharing one token as in indexed datasets; the
    tokens left over that fill no whole sample are dropped (fewer than seq_length per window);
  - the window's samples are shuffled (the bounded shuffle buffer) and handed out in order.
A window is a pure function of its index, so DataLoader workers tokenize windows in parallel
(worker w takes every W-th window and the loader returns them in order); the worker count
changes nothing. Every rank of every data-parallel size walks the same global sample order and
keeps its slice, so the position is (window, offset) per source, saved in the checkpoint, and a
run resumes exactly, under any data-parallel size.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.config.tokenizer import TokenizerConfig
from engine.data.indexed.gpt_dataset import SPLIT_NAMES, split_ranges
from engine.data.indexed.helpers import build_blending_indices
from engine.data.loader import collate_samples, obey_only_the_rank
from engine.data.streaming.shards import Shard, ShardCursor
from engine.data.tokenizers import build_tokenizer
from engine.errors import ConfigError, InputError

ORDER_RULES = 2  # the version of the cutting and blending rules (see fingerprint)


@dataclass(frozen=True)
class StreamPlan:
    """Which rows of which shards form window k of one source's split, and how they are packed."""

    shards: tuple[Shard, ...]
    tokenizer: str  # Tokenizer.identity(): packing depends on what it does, not its path
    column: str
    window_rows: int
    seq_length: int
    seed: int
    split: tuple[float, float, float]
    split_index: int

    @property
    def windows_per_epoch(self) -> int:
        return sum(math.ceil(s.num_rows / self.window_rows) for s in self.shards)

    def fingerprint(self) -> dict:
        """What a saved position depends on; a resumed run must match it."""
        return {
            # 2: splits cut and sources blended by megatron-core's rules; positions saved
            # under the earlier rules point at other rows
            "rules": ORDER_RULES,
            "shards": [[s.name, s.num_rows] for s in self.shards],
            "tokenizer": self.tokenizer,
            "column": self.column,
            "window_rows": self.window_rows,
            "seq_length": self.seq_length,
            "seed": self.seed,
            "split": list(self.split),
            "split_name": SPLIT_NAMES[self.split_index],
        }

    def has_rows(self) -> bool:
        """Whether this split's share of some window is at least one row."""
        sizes = {min(self.window_rows, s.num_rows) for s in self.shards}
        sizes |= {s.num_rows % self.window_rows for s in self.shards}
        split = list(self.split)
        return any(
            end > start for start, end in (split_ranges(n, split)[self.split_index] for n in sizes)
        )

    def _rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.split_index, *keys])

    def _epoch_order(self, epoch: int) -> tuple[np.ndarray, list[int]]:
        order = self._rng(epoch).permutation(len(self.shards))
        counts = [math.ceil(self.shards[i].num_rows / self.window_rows) for i in order]
        return order, list(itertools.accumulate(counts))

    def window_rows_of(self, k: int, epoch_orders: dict) -> tuple[Shard, int, int]:
        """(shard, first row, end row) of this split's rows of window k."""
        epoch, j = divmod(k, self.windows_per_epoch)
        if epoch not in epoch_orders:
            epoch_orders.clear()
            epoch_orders[epoch] = self._epoch_order(epoch)
        order, ends = epoch_orders[epoch]
        position = bisect.bisect_right(ends, j)
        shard = self.shards[order[position]]
        start = (j - (ends[position - 1] if position else 0)) * self.window_rows
        stop = min(start + self.window_rows, shard.num_rows)
        first, end = split_ranges(stop - start, list(self.split))[self.split_index]
        return shard, start + first, start + end

    def pack(self, k: int, documents: list[list[int]], eod: int) -> np.ndarray:
        """Window k's samples [n, seq_length + 1], shuffled."""
        lengths = [len(ids) + 1 for ids in documents if ids]
        tokens = np.empty(sum(lengths), dtype=np.int64)
        at = 0
        for ids in documents:
            if ids:
                tokens[at : at + len(ids)] = ids
                tokens[at + len(ids)] = eod
                at += len(ids) + 1
        s = self.seq_length
        count = max(0, (len(tokens) - 1) // s)
        if count == 0:
            return np.empty((0, s + 1), dtype=np.int64)
        views = np.lib.stride_tricks.sliding_window_view(tokens[: count * s + 1], s + 1)[::s]
        return views[self._rng(k // self.windows_per_epoch, k).permutation(count)]


@dataclass
class _WindowFailed:
    """A worker's error, passed back as a value so the trainer reports one line."""

    message: str


class _WindowProducer(torch.utils.data.IterableDataset):
    """Windows first_window, first_window + 1, ... as (k, samples); worker w of W yields every
    W-th one, which the DataLoader puts back in order."""

    def __init__(self, plan: StreamPlan, tokenizer: TokenizerConfig, first_window: int):
        self.plan = plan
        self.tokenizer = tokenizer
        self.first_window = first_window

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        try:
            tokenizer = build_tokenizer(self.tokenizer)
        except InputError as err:
            yield _WindowFailed(str(err))
            return
        cursor = ShardCursor(self.plan.column)
        epoch_orders: dict = {}
        for k in itertools.count(self.first_window + worker, workers):
            shard, start, stop = self.plan.window_rows_of(k, epoch_orders)
            try:
                texts = cursor.texts(shard, start, stop)
                documents = tokenizer.tokenize_batch(texts) if texts else []
            except InputError as err:  # the cursor's errors name the shard and row already
                message = str(err)
                if not message.startswith(shard.path):  # the tokenizer's do not
                    message = f"{shard.path}: rows {start}-{stop - 1}: {message}"
                yield _WindowFailed(message)
                return
            except (TypeError, UnicodeError, ValueError) as err:  # e.g. lone surrogates
                yield _WindowFailed(f"{shard.path}: rows {start}-{stop - 1}: {err}")
                return
            yield k, self.plan.pack(k, documents, tokenizer.eod)


class SampleStream:
    """One source's split as a sequence of samples, from a saved (window, offset) on."""

    def __init__(
        self, plan: StreamPlan, tokenizer: TokenizerConfig, num_workers: int, position=None
    ):
        self.plan = plan
        self.tokenizer = tokenizer
        self.num_workers = num_workers
        self.window, self.offset = (0, 0) if position is None else position
        self.samples = None
        self.windows = None

    def position(self) -> tuple[int, int]:
        return self.window, self.offset

    def next(self) -> np.ndarray:
        empty = 0
        while self.samples is None or self.offset >= len(self.samples):
            if self.samples is not None:
                self.window, self.offset = self.window + 1, 0
            self.samples = self._fetch()
            empty = empty + 1 if len(self.samples) == 0 else 0
            if empty >= self.plan.windows_per_epoch:
                raise InputError(
                    f"{self.plan.shards[0].path}: no window of --parquet-shuffle-buffer "
                    f"{self.plan.window_rows} rows holds seq-length + 1 = "
                    f"{self.plan.seq_length + 1} tokens in the {SPLIT_NAMES[self.plan.split_index]}"
                    " split; raise --parquet-shuffle-buffer or lower --seq-length",
                    every_rank=True,
                )
        sample = self.samples[self.offset]
        self.offset += 1
        return sample

    def _fetch(self) -> np.ndarray:
        if self.windows is None:
            loader = torch.utils.data.DataLoader(
                _WindowProducer(self.plan, self.tokenizer, self.window),
                batch_size=None,
                num_workers=self.num_workers,
                worker_init_fn=obey_only_the_rank,
                # Its own generator: starting a loader must not draw from the global one, which
                # drives dropout (a resumed run would be one draw off the uninterrupted run).
                generator=torch.Generator().manual_seed(self.plan.seed),
            )
            self.windows = iter(loader)
        item = next(self.windows)
        if isinstance(item, _WindowFailed):
            raise InputError(item.message, every_rank=True)
        k, samples = item
        if k != self.window:
            raise RuntimeError(f"streaming loader returned window {k}, expected {self.window}")
        return samples.numpy() if isinstance(samples, torch.Tensor) else samples


class StreamingDataset:
    """One split of one or more weighted Parquet sources, `num_samples` samples long, as a
    training split (engine/data/split.py)."""

    def __init__(
        self,
        plans: list[StreamPlan],
        weights: list[float],
        num_samples: int,
        tokenizer: TokenizerConfig,
        names: list[str] | tuple[str, ...] = (),
    ):
        self.plans = plans
        self.names = tuple(names) or tuple(f"dataset{d}" for d in range(len(plans)))
        self.weights = weights
        self.num_samples = num_samples
        self.tokenizer = tokenizer
        self.which = None
        if len(plans) > 1:
            self.which, _ = build_blending_indices(weights, num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def fingerprint(self) -> list[dict]:
        return [plan.fingerprint() for plan in self.plans]

    def iterator(
        self,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        num_workers: int = 0,
        position: dict | None = None,
        pin_memory: bool = False,
    ) -> StreamingIterator:
        """This DP rank's micro-batches from `consumed_samples` on, each source's stream from
        the saved `position` (a StreamingIterator.state_dict; None: from the start)."""
        positions = self.resume_positions(consumed_samples, position)
        streams = [
            SampleStream(plan, self.tokenizer, num_workers, positions[i] if positions else None)
            for i, plan in enumerate(self.plans)
        ]
        return StreamingIterator(
            self, streams, consumed_samples, micro_batch_size, dp_rank, dp_size, pin_memory
        )

    def check_position(self, consumed_samples: int, position: dict | None) -> None:
        """On a rank that reads no batches: fail (on every rank alike) where `iterator` would
        for this count and position."""
        self.resume_positions(consumed_samples, position)

    def restart_point(self, consumed_samples: int) -> int:
        """A stream is positioned by what it saved; without that it starts again."""
        return 0

    def consumed_per_dataset(self, consumed_samples: int) -> None:
        """Which source gave each sample is known only while reading."""
        return None

    def resume_positions(self, consumed_samples: int, state: dict | None) -> list | None:
        """The stream positions of a checkpoint's data state (None: from the start), checked
        against this data and the counters; the same answer on every rank."""
        positions = None
        if state is not None:
            if state.get("sources") != self.fingerprint():
                raise ConfigError(
                    "--data-path: the checkpoint's Parquet stream position belongs to other "
                    "shards or settings (shards, --parquet-text-column, --parquet-shuffle-buffer,"
                    " --seq-length, --seed or --split changed); give the same data and settings "
                    "to resume, or --save to a new folder and train from --load without resuming"
                    " (see docs/data.md: Streaming from Parquet)",
                    every_rank=True,  # every rank holds the same checkpoint and data
                )
            if state["consumed_samples"] != consumed_samples:
                raise ConfigError(
                    f"the checkpoint's Parquet stream position is at sample "
                    f"{state['consumed_samples']}, its counters at {consumed_samples}; the "
                    "checkpoint is inconsistent, resume from an earlier one",
                    every_rank=True,
                )
            positions = [tuple(p) for p in state["positions"]]
        elif consumed_samples:
            raise ConfigError(
                f"the checkpoint consumed {consumed_samples} samples but holds no Parquet stream "
                "position (it was trained on other data); resume it with --data-path of the data "
                "it was trained on",
                every_rank=True,
            )
        return positions


class StreamingIterator:
    """Micro-batches for one data-parallel rank. Every rank draws each micro-step's
    micro_batch_size x dp_size samples of the global order and keeps its slice, so the global
    order, and the saved position, are the same for every data-parallel size."""

    def __init__(
        self,
        dataset,
        streams,
        consumed_samples,
        micro_batch_size,
        dp_rank,
        dp_size,
        pin_memory: bool = False,
    ):
        self.dataset = dataset
        self.pin_memory = pin_memory
        self.streams = streams
        self.consumed = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step = self.micro_batch_size * self.dp_size
        if self.consumed + step > self.dataset.num_samples:
            raise StopIteration
        first = self.dp_rank * self.micro_batch_size
        mine = []
        for i in range(step):
            which = 0 if self.dataset.which is None else int(self.dataset.which[self.consumed + i])
            sample = self.streams[which].next()
            if first <= i < first + self.micro_batch_size:
                # with several sources, each sample says which it came from (per-source losses)
                mine.append(sample if self.dataset.which is None else (sample, which))
        self.consumed += step
        batch = collate_samples(mine)
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def state_dict(self) -> dict:
        """The position after the samples drawn so far (all ranks hold the same)."""
        return {
            "consumed_samples": self.consumed,
            "sources": self.dataset.fingerprint(),
            "positions": [list(s.position()) for s in self.streams],
        }
