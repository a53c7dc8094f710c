"""A run stops rather than train on, or save, weights that hold NaN or Inf.

Non-finite gradients are caught each step (the update is skipped, --exit-on-nan-count
counts them); weights can still overflow through finite gradients and a learning rate too
large for them. The weights this rank holds are summed (a NaN or Inf anywhere makes the sum
non-finite) and the sums agreed over every rank: at each log line and before each save, so
that no checkpoint is written from a broken model. One pass over the weights each time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.checkpoint.files import find_latest


class NonFiniteWeights(Exception):
    """The weights hold NaN or Inf after an update: the run stops, checkpoints kept."""


def weights_are_finite(chunks, optimizer, group, device: torch.device) -> bool:
    """Collective over `group`: whether every weight on every rank is finite."""
    optimizer.finish_param_sync()  # the updated values in place where they are gathered
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ddp in chunks:
        for param in ddp.params:
            for _, _, values in ddp.held_pieces(param):
                total += values.sum(dtype=torch.float64)
    if group is not None and dist.is_initialized():
        dist.all_reduce(total, group=group)
    return bool(torch.isfinite(total))


def stop_on_non_finite_weights(run, where: str) -> None:
    """NonFiniteWeights naming the iteration and the newest checkpoint, when a weight is NaN
    or Inf (collective over the world; once per iteration: a save right after the log line
    does not read the weights again)."""
    state, c = run.state, run.progress.counters
    if run.progress.weights_checked == c.iteration:
        return
    if weights_are_finite(run.chunks, run.optimizer, state.world_group, state.device):
        run.progress.weights_checked = c.iteration
        return
    latest = find_latest(run.cfg.checkpointing.save)
    kept = f"checkpoint {latest} is the latest" if latest else "no checkpoint was saved"
    raise NonFiniteWeights(
        f"stopping at iteration {c.iteration}: the weights hold NaN or Inf after the update "
        f"({where}); {kept}; lower --lr (or give --clip-grad) and resume from it"
    )
