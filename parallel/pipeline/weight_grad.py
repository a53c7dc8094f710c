"""Deferred weight gradients, for zero-bubble pipeline schedules.

A backward run inside `WeightGradQueue.collecting(parameters)` computes the input gradients
as usual, but each linear layer whose weight gradient goes straight into its fp32 `main_grad`
(parallel/tensor_parallel/linear_function.py's gradient-accumulation fusion) queues that GEMM
instead of running it; `run()` does the queued GEMMs later (the schedule's W action), adding into
`main_grad` and telling the data-parallel wrapper each gradient is in, as the backward would have.
Other parameters (norms, biases, embeddings, weights without a `main_grad`) get their gradients in
the backward itself. The queue is found through an attribute set on the parameters for the
duration of `collecting`, not through global state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

QUEUE_ATTRIBUTE = "weight_grad_queue"


class WeightGradQueue:
    def __init__(self):
        self.work: list[Callable[[], None]] = []
        self.deferred: set[int] = set()  # ids of the parameters whose gradient is queued

    @contextlib.contextmanager
    def collecting(self, parameters: Iterable[torch.nn.Parameter]):
        params = list(parameters)
        for param in params:
            setattr(param, QUEUE_ATTRIBUTE, self)
        try:
            yield self
        finally:
            for param in params:
                delattr(param, QUEUE_ATTRIBUTE)

    def add(self, param: torch.nn.Parameter, work: Callable[[], None]) -> None:
        self.work.append(work)
        self.deferred.add(id(param))

    def defers(self, param: torch.nn.Parameter) -> bool:
        """Whether param's gradient of this backward waits in the queue (the data-parallel
        wrapper must not count it in before `run`)."""
        return id(param) in self.deferred

    def run(self) -> None:
        """The queued GEMMs, outside autograd (as inside a backward)."""
        work, self.work = self.work, []
        self.deferred = set()
        with torch.no_grad():
            for item in work:
                item()
