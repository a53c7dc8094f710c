"""Stopping a run early and cleanly, as Megatron-LM does: after --exit-duration-in-mins of
wall-clock time since the processes started (the earliest rank's start; 0 means no limit, as
there), or on a signal (SIGTERM by default) with --exit-signal-handler, the run saves
a checkpoint at the end of the current iteration and exits with code 0, so that a preempted or
time-limited Slurm job can be resubmitted and resume where it stopped. With the handler on, SIGINT
(Ctrl-C to engine.launch, which passes it on to the ranks) saves the same way, and a second
signal (more than SAME_STOP_SECONDS after the first) stops at once without saving
(KeyboardInterrupt: "interrupted; latest checkpoint N").

Every rank must stop at the same iteration, so the decision is agreed each iteration by an
all-reduce (max) of each rank's view: one rank that received the signal or ran out of time is
enough.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

# Slurm signals every process of a job step, launcher and ranks alike, and the launcher passes
# the signal on: within this many seconds a second signal is that same stop.
SAME_STOP_SECONDS = 5.0


class ExitConditions:
    """The wall-clock limit and the signal flag, checked once per iteration."""

    def __init__(
        self,
        duration_minutes: float | None,
        signal_handler: bool,
        signal_name: str = "SIGTERM",
        started: float | None = None,
    ):
        """`started`: the run's start as time.time() (see earliest_start)."""
        self.duration_minutes = duration_minutes or None  # 0: no limit, as in Megatron-LM
        self.started = time.time() if started is None else started
        self.signal_number = getattr(signal, signal_name) if signal_handler else None
        self.received: int | None = None  # the signal acted on at the end of the iteration
        self.received_at = 0.0
        self.previous: dict[int, object] = {}
        if self.signal_number is not None:
            # engine.launch (torchrun) passes the launcher's SIGINT (Ctrl-C) on to the ranks
            for number in {self.signal_number, signal.SIGINT}:
                self.previous[number] = signal.signal(number, self._on_signal)

    @property
    def active(self) -> bool:
        return self.duration_minutes is not None or self.signal_number is not None

    def _on_signal(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received is not None:
            if now - self.received_at < SAME_STOP_SECONDS:
                return  # the same stop delivered twice: to this rank and through its launcher
            raise KeyboardInterrupt  # a second one: stop now, without saving
        self.received, self.received_at = signum, now  # acted on at the end of the iteration

    def check(self, group, device: torch.device) -> str | None:
        """Collective over `group` (every rank calls it each iteration when active): why the
        run stops now, or None."""
        if not self.active:
            return None
        elapsed = (time.time() - self.started) / 60.0
        timed_out = self.duration_minutes is not None and elapsed > self.duration_minutes
        received = float(self.received or 0)
        views = torch.tensor([float(timed_out), received], device=device)
        if group is not None and dist.is_initialized():
            dist.all_reduce(views, op=dist.ReduceOp.MAX, group=group)
        timed_out, received = views.tolist()  # one wait for the device
        timed_out, received = bool(timed_out), int(received)
        if received:
            return f"received {signal.Signals(received).name} (--exit-signal-handler)"
        if timed_out:
            return f"ran for more than {self.duration_minutes:g} minutes (--exit-duration-in-mins)"
        return None

    def close(self) -> None:
        """Give the signals back to the handlers they had before."""
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}


def earliest_start(started: float, group, device: torch.device) -> float:
    """The earliest of the ranks' start times (collective over `group`)."""
    if group is None or not dist.is_initialized():
        return started
    value = torch.tensor([started], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return float(value.item())
