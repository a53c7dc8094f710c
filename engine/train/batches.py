"""A rank's micro-batches for the loop and for evaluation: which stages read batches, the
iterator over a split from a consumed count, and the next micro-batches on the device."""

from __future__ import annotations

import torch

from engine.data.documents import Packing
from engine.data.split import SplitIterator, TrainingSplit
from parallel.state import ParallelState


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def domain_names(split: TrainingSplit | None) -> tuple[str, ...]:
    """The names of the datasets a split blends, when it blends several (their losses are
    reported one by one); () otherwise."""
    names = split.names if split is not None else ()
    return tuple(names) if len(names) > 1 else ()


def micro_batches_per_step(micro_batch_size: int, state: ParallelState, global_batch: int) -> int:
    """This DP rank's micro-batches in a step of `global_batch` samples."""
    return global_batch // (micro_batch_size * state.dp_size)


def loads_batches(state: ParallelState, packing: Packing | None = None) -> bool:
    """Only the first pipeline stage (tokens) and the last (labels) read token batches, as in
    Megatron-LM; a stage in between gets its input from the previous stage alone, unless its
    layers need the samples' positions or documents (`packing`), which it then computes from
    the same tokens (nothing but the hidden states travels between stages)."""
    every = packing is not None and packing.every_stage
    return every or state.is_first_stage or state.is_last_stage


def data_iterator(
    state: ParallelState,
    micro_batch_size: int,
    split: TrainingSplit,
    consumed: int,
    num_workers: int,
    position: dict | None = None,
    packing: Packing | None = None,
) -> SplitIterator | None:
    """This DP rank's micro-batches of a split from `consumed` samples on (from its saved
    `position` where it keeps one); None on a pipeline stage that reads no batches."""
    if not loads_batches(state, packing):
        split.check_position(consumed, position)  # a bad data state fails on every rank
        return None
    pin = state.device.type == "cuda"  # page-locked batches copy to the GPU asynchronously
    return split.iterator(
        consumed, micro_batch_size, state.dp_rank, state.dp_size, num_workers, position, pin
    )


def next_batches(
    iterator, count: int, device: torch.device, packing: Packing | None = None
) -> list[dict]:
    """`count` micro-batches on `device` (empty ones where this stage reads none), with their
    documents' positions, ids and loss mask where `packing` asks for them."""
    if iterator is None:
        return [{} for _ in range(count)]
    batches = [to_device(next(iterator), device) for _ in range(count)]
    return batches if packing is None else [packing.annotate(b) for b in batches]
