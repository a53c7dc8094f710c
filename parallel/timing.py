"""Where a training step's time goes: wall-clock seconds per named part, summed until taken.

The engine makes one `StepTimes` per run and hands it to what does the work (the pipeline
schedules time forward and backward compute, the p2p layer its waits, the engine the rest).
A part may be measured inside another (the tensor-parallel collectives inside forward and
backward compute): the inner time is its own and is taken out of the enclosing part, so the
parts never count the same second twice and add up to the step. `sync` (e.g.
torch.cuda.synchronize, with --timing-log-level 1 or more) is called at both ends of every
measurement so that a GPU's queued work is counted where it runs; without it the numbers are
host time and no synchronisation is added.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable


class StepTimes:
    """Seconds per part since the last `take()`. `clock`: seconds now (time.perf_counter; a
    test gives its own)."""

    def __init__(
        self,
        sync: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.sync, self.clock = sync, clock
        self.totals: dict[str, float] = {}
        self.paused_depth = 0
        self.open_nested: list[float] = []  # seconds of the inner parts of each open measure

    def add(self, part: str, seconds: float) -> None:
        if not self.paused_depth:
            self.totals[part] = self.totals.get(part, 0.0) + seconds

    @contextlib.contextmanager
    def paused(self):
        """Nothing inside is counted (work measured as a whole by an enclosing part)."""
        self.paused_depth += 1
        try:
            yield
        finally:
            self.paused_depth -= 1

    @contextlib.contextmanager
    def measure(self, part: str):
        if self.sync is not None:
            self.sync()
        start = self.clock()
        self.open_nested.append(0.0)
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            elapsed = self.clock() - start
            inner = self.open_nested.pop()
            if not self.paused_depth:
                self.add(part, elapsed - inner)
                if self.open_nested:
                    self.open_nested[-1] += elapsed

    def take(self) -> dict[str, float]:
        """The totals so far, then start again from zero."""
        totals, self.totals = self.totals, {}
        return totals


def measure(times: StepTimes | None, part: str):
    """`times.measure(part)`, or nothing when no one is timing."""
    return times.measure(part) if times is not None else contextlib.nullcontext()
