"""--rerun-on-nan (Megatron-LM's --rerun-mode validate_results): a step whose loss or gradient
is NaN/Inf is computed again from the same state and data, to tell a flaky device from a bad
batch.

A skipped step leaves the weights, the optimizer and the learning-rate schedule as they were,
so the second computation needs only the random states (dropout) and the loss-spike history
put back. Finite the second time: a transient fault, logged with the ranks whose own gradient
was non-finite before the reduction spread it; the step goes on with the new result.
Non-finite again: the data or the model; the batch's samples are logged and the step is
skipped as without the flag (--exit-on-nan-count counts it). The cost: each step keeps a copy of
the random states (and FP8's delayed-scaling state), and sums its local gradient once after
backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.checkpoint.state import rng_state, set_rng_state
from engine.ops.fp8.apply import delayed_states


class StepSnapshot:
    """What a rerun of the step puts back: the random states, the spike detector's history
    and FP8 delayed scaling's amax histories and scales (updated at the end of every step,
    skipped or not, as Transformer Engine does)."""

    def __init__(self, run):
        self.rank, self.tracker = run.state.rank, run.progress.tracker
        self.rng = rng_state(self.rank, self.tracker)
        self.spikes = list(run.spikes.history)
        self.fp8 = [
            (s.history.clone(), s.scale.clone(), s.amax_now.clone())
            for s in delayed_states(run.chunks)
        ]

    def restore(self, run) -> None:
        set_rng_state({k.split("/", 2)[2]: v for k, v in self.rng.items()}, self.tracker)
        run.spikes.history = list(self.spikes)
        for state, saved in zip(delayed_states(run.chunks), self.fp8, strict=True):
            state.history, state.scale, state.amax_now = (t.clone() for t in saved)
            state.seen = None  # read from the history put back


def local_gradients_finite(chunks, device: torch.device) -> torch.Tensor:
    """Whether this rank's gradient buffers hold only finite values, as a flag on the device
    (read only when the step turns out non-finite: no wait for the device here). Taken after
    backward; where the reduction overlaps backward, some buckets may already be reduced."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ddp in chunks:
        for buffer in ddp.buffers:
            if buffer.grad_buffer is not None:
                total += buffer.grad_buffer.sum(dtype=torch.float64)
    return torch.isfinite(total).to(torch.float32).reshape(1)


def ranks_without(finite: torch.Tensor, state) -> list[int]:
    """The ranks whose flag is 0 (collective over every rank)."""
    if state.world_group is None:
        return [] if bool(finite.item()) else [state.rank]
    every = [torch.zeros_like(finite) for _ in range(state.world_size)]
    dist.all_gather(every, finite, group=state.world_group)
    return [rank for rank, flag in enumerate(torch.cat(every).tolist()) if not flag]


def report(iteration: int, ranks: list[int], rerun_loss: float, finite_again: bool, samples):
    """The console line of a rerun."""
    where = (
        f"non-finite local gradient on rank(s) {', '.join(map(str, ranks))}"
        if ranks
        else "every rank's local gradient was finite: the loss or the reduction"
    )
    if finite_again:
        return (
            f"iteration {iteration}: NaN/Inf loss or gradient ({where}); recomputed from the "
            f"same state and data: finite (lm loss {rerun_loss:.4f}), a transient fault; the "
            "step goes on with the recomputed result (--rerun-on-nan)"
        )
    first, count = samples
    return (
        f"iteration {iteration}: NaN/Inf loss or gradient ({where}); recomputed from the same "
        f"state and data: NaN/Inf again, so the data or the model: the global batch of "
        f"training samples {first} to {first + count - 1} (in the order the run reads them); "
        "the step is skipped (--rerun-on-nan)"
    )
