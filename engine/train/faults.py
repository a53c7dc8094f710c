"""Fault injection for the robustness tests. Inert unless one of these variables is set:

    TRIPOD_FAULT_NAN_GRAD_AT=3,4      rank 0 turns a local gradient NaN at these iterations
                                      (before the data-parallel reduction, as a real one)
    TRIPOD_FAULT_RANDOM_BATCH_AT=25   that iteration trains on uniformly random tokens
    TRIPOD_FAULT_RANDOM_SAMPLES_AT=57 the global batch that holds training sample 57 is
                                      uniformly random tokens (bad data: skipping that stretch
                                      of the data skips the fault)
    TRIPOD_FAULT_NAN_BATCH_AT=3       that iteration's batch is poisoned: its loss mask is NaN
                                      (a NaN loss however often it is computed)
    TRIPOD_FAULT_RAISE_AT=1:3         rank 1 raises an exception at iteration 3
    TRIPOD_FAULT_KILL_AT=1:3          rank 1 kills itself (SIGKILL) at iteration 3: at its start,
                                      or with TRIPOD_FAULT_KILL_IN=PART as it enters that part of
                                      the time breakdown (forward-compute, backward-compute,
                                      pipeline-wait, grads-sync, optimizer, save-checkpoint)
    TRIPOD_FAULT_STALL_AT=1:3         rank 1 stops making progress at iteration 3 (sleeps in
                                      compute; its peers then wait in their next collective)
    TRIPOD_FAULT_SLOW_RANK=1:0.2      rank 1 takes 0.2 s longer to read each batch (a straggler)
    TRIPOD_FAULT_SIGTERM_AT=1:3       rank 1 is sent SIGTERM at iteration 3 (as Slurm sends it
                                      to a job it preempts or that reaches its time limit;
                                      TRIPOD_FAULT_SIGNAL=SIGUSR1 sends that signal instead)
    TRIPOD_FAULT_PERTURB_WEIGHT_AT=1:3  rank 1 changes one of its weights after the update of
                                      iteration 3 (a replica drifting from the others): the
                                      first, or with TRIPOD_FAULT_PERTURB_WEIGHT=NAME the first
                                      whose name holds NAME; by 1.0, or by
                                      TRIPOD_FAULT_PERTURB_BY (nan: a weight gone non-finite)

(A kill in the middle of a save is engine/checkpoint/faults.py's, and so is TRIPOD_FAULT_ATTEMPT,
which limits every fault to one attempt of a restarted job.)

Iterations are 1-based: the iteration being computed, as logged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import torch

from engine.checkpoint.faults import in_faulty_attempt, rank_at
from parallel.timing import StepTimes


def _iterations(name: str) -> set[int]:
    value = os.environ.get(name, "") if in_faulty_attempt() else ""
    return {int(x) for x in value.split(",") if x.strip()}


class KillingTimes(StepTimes):
    """The step's timer, which kills this rank as it enters TRIPOD_FAULT_KILL_IN's part."""

    def __init__(self, sync, rank: int):
        super().__init__(sync)
        self.rank, self.iteration = rank, 0

    @contextlib.contextmanager
    def measure(self, part: str):
        if part == os.environ.get("TRIPOD_FAULT_KILL_IN") and rank_at(
            "TRIPOD_FAULT_KILL_AT", self.rank, self.iteration
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        with super().measure(part):
            yield


def step_times(sync, rank: int) -> StepTimes:
    """The run's timer: a KillingTimes where TRIPOD_FAULT_KILL_IN asks for one."""
    return KillingTimes(sync, rank) if os.environ.get("TRIPOD_FAULT_KILL_IN") else StepTimes(sync)


def before_iteration(
    rank: int,
    iteration: int,
    batches: list[dict],
    vocab_size: int,
    times=None,
    samples: tuple[int, int] | None = None,
) -> None:
    """`samples`: [start, end) of the training samples the global batch holds."""
    if isinstance(times, KillingTimes):
        times.iteration = iteration
    if rank_at("TRIPOD_FAULT_RAISE_AT", rank, iteration):
        raise RuntimeError(f"injected failure at iteration {iteration}")
    if rank_at("TRIPOD_FAULT_KILL_AT", rank, iteration) and not os.environ.get(
        "TRIPOD_FAULT_KILL_IN"
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank_at("TRIPOD_FAULT_STALL_AT", rank, iteration):
        while True:
            time.sleep(60)
    if rank_at("TRIPOD_FAULT_SIGTERM_AT", rank, iteration):
        name = os.environ.get("TRIPOD_FAULT_SIGNAL", "SIGTERM")
        os.kill(os.getpid(), signal.Signals[name])
    if iteration in _iterations("TRIPOD_FAULT_NAN_BATCH_AT"):
        for batch in (b for b in batches if "labels" in b):  # the stages that compute the loss
            batch["loss_mask"] = torch.full(batch["labels"].shape, float("nan"))
    bad_data = samples is not None and any(
        samples[0] <= k < samples[1] for k in _iterations("TRIPOD_FAULT_RANDOM_SAMPLES_AT")
    )
    if iteration in _iterations("TRIPOD_FAULT_RANDOM_BATCH_AT") or bad_data:
        generator = torch.Generator().manual_seed(samples[0] if bad_data else iteration)
        for batch in (b for b in batches if "tokens" in b):  # a middle stage reads none
            noise = torch.randint(0, vocab_size, batch["tokens"].shape, generator=generator)
            batch["tokens"] = noise.to(batch["tokens"].device)
            batch["labels"] = noise.roll(-1, dims=1).to(batch["labels"].device)


def while_reading(rank: int) -> None:
    """Inside the timed reading of an iteration's batches."""
    slow = os.environ.get("TRIPOD_FAULT_SLOW_RANK", "")
    if slow and in_faulty_attempt() and slow.split(":")[0] == str(rank):
        time.sleep(float(slow.split(":")[1]))


def after_update(rank: int, iteration: int, chunks) -> None:
    if rank_at("TRIPOD_FAULT_PERTURB_WEIGHT_AT", rank, iteration):
        ddp = chunks[0]
        part = os.environ.get("TRIPOD_FAULT_PERTURB_WEIGHT", "")
        param = next(p for n, p in ddp.module.named_parameters() if part in n)
        with ddp.gathered_parameters(), torch.no_grad():
            param.view(-1)[0] += float(os.environ.get("TRIPOD_FAULT_PERTURB_BY", "1.0"))


def after_backward(rank: int, iteration: int, chunks) -> None:
    if rank == 0 and iteration in _iterations("TRIPOD_FAULT_NAN_GRAD_AT"):
        ddp = chunks[0]  # this rank's gradient, whole or (sharded gradients) its shard
        grad = next(g for p in ddp.params for g in ddp.reduced_grads(p) if g.numel())
        grad[0] = float("nan")
