"""Resumable, data-parallel-aware micro-batch iteration over a global sample order.

Global batch g holds samples [g * G, (g + 1) * G) of the dataset, G the global batch size. It
is consumed in micro-steps of micro_batch_size * dp samples; DP rank r takes the r-th slice of
each. Sample k is therefore the same whatever the DP size, and a run resumes (under any DP
size) from the count of samples consumed so far.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator

import numpy as np
import torch

from engine.errors import ConfigError


class PretrainingSampler:
    """Yields, for one DP rank, the sample indices of each of its micro-batches."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"data-parallel rank {dp_rank} is outside size {dp_size}")
        if consumed_samples > total_samples:
            raise ConfigError(
                f"{consumed_samples} samples were consumed but the dataset has {total_samples}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        first = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + first, start + first + self.micro_batch_size))

    def __len__(self) -> int:
        step = self.micro_batch_size * self.dp_size
        return max(0, (self.total_samples - self.consumed_samples) // step)


def collate_samples(samples: list) -> dict[str, torch.Tensor]:
    """Stack samples of seq_length + 1 ids into inputs `tokens` and shifted `labels`; samples
    given as (ids, dataset index) pairs also give `domain`, the dataset of each sample."""
    domains = None
    if samples and isinstance(samples[0], tuple):
        samples, domains = [s for s, _ in samples], [d for _, d in samples]
    batch = torch.from_numpy(np.stack(samples))
    out = {"tokens": batch[:, :-1].contiguous(), "labels": batch[:, 1:].contiguous()}
    if domains is not None:
        out["domain"] = torch.tensor(domains, dtype=torch.long)
    return out


class WithDomains:
    """A blended dataset whose samples come with the index of the dataset they are from."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple:
        return self.dataset[i], self.dataset.domain(i)


def build_data_iterator(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches for this DP rank from consumed_samples on (in page-locked memory with
    pin_memory, for asynchronous copies to a GPU)."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_samples,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Workers inherit the memory-mapped dataset by fork (it holds open files, which a
        # forkserver or spawn start would have to pickle); fork is Linux's default start anyway.
        multiprocessing_context=_worker_start_method() if num_workers > 0 else None,
        worker_init_fn=obey_only_the_rank,
        # Its own generator: creating the iterator must not draw from the global one, or a
        # resumed run's dropout masks would be one draw off the uninterrupted run's.
        generator=torch.Generator().manual_seed(consumed_samples),
    )
    return iter(loader)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def obey_only_the_rank(worker_id: int | None = None) -> None:
    """A data-loader worker's start: the signals that stop a run are the rank's to act on.

    torchrun passes the launcher's SIGTERM/SIGINT to each rank's whole process group, a
    terminal's Ctrl-C reaches its foreground group, and Slurm signals every process of a job
    step (at its time limit, on preemption, on `scancel --signal`): a worker that died of one
    would end the rank with a traceback before --exit-signal-handler's save. So the worker
    leaves its rank's process group, and a thread takes SIGTERM and SIGINT from then on: sent
    by the rank (the loader's shutdown, Python's exit-time clean-up) they end the worker at
    once; sent by anyone else they are left to the rank. The worker also ends when it sees its
    rank gone (the loader's own watchdog)."""
    os.setpgid(0, 0)
    if hasattr(signal, "sigwaitinfo"):  # (Linux; elsewhere the process group is all)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        threading.Thread(target=_stop_when_the_rank_says, daemon=True).start()


def _stop_when_the_rank_says() -> None:
    rank = os.getppid()
    while True:
        received = signal.sigwaitinfo(STOP_SIGNALS)
        if received.si_pid == rank:
            os._exit(0)


def _worker_start_method() -> str:
    return "fork" if sys.platform == "linux" else "spawn"
