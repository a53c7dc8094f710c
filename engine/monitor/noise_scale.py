"""The gradient noise scale (`--log-gradient-noise-scale`): McCandlish et al., "An Empirical
Model of Large-Batch Training" (2018), appendix A, from gradient norms at two batch sizes.

Each data-parallel rank's own gradient (over its B_small = global batch / DP samples, before
the DP reduction) and the reduced one (over all B_big samples) give unbiased estimates of the
true gradient's squared norm and of the per-sample covariance's trace:

    |G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    S     ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

with |G_small|^2 the mean over the DP ranks. Each is noisy, so both are smoothed by an
exponential moving average before the ratio B_simple = S / |G|^2 is taken, as the paper
advises. A rank's own gradient is read from each DDP bucket right before its reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.grads import counts_toward_norm
from parallel.tensor_parallel.sharding import has_tp_partial_grad


class LocalGradSquares:
    """Sums the squares of this rank's own (unreduced) main grads, each element once over
    TP (and over PP, by summing the stages), while it is attached to the DDP wrappers. A
    replicated parameter whose TP ranks hold partial gradients (norms under SP) is copied
    aside and summed over TP first: its DP reduction may start before that sum."""

    def __init__(self, ddps, tp_rank: int):
        self.ddps, self.tp_rank = ddps, tp_rank
        self.total: torch.Tensor | None = None
        self.partial: dict = {}  # param -> its partial gradient, summed in ddp.params order

    def attach(self, device) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.partial = {}
        for ddp in self.ddps:
            ddp.before_reduce = self._add

    def _add(self, bucket) -> None:
        for param in bucket.params:
            if has_tp_partial_grad(param):
                self.partial[param] = param.main_grad.detach().double().flatten()
            elif counts_toward_norm(param, self.tp_rank):
                self.total += param.main_grad.double().square().sum()

    def detach(self, state, loss_scale: float = 1.0) -> float:
        """The mean over DP ranks of |own gradient|^2 (collective on all ranks)."""
        for ddp in self.ddps:
            ddp.before_reduce = None
        if state.tp_group is not None:  # every TP rank holds the same replicated parameters
            ordered = [self.partial[p] for d in self.ddps for p in d.params if p in self.partial]
            partial = torch.cat(ordered) if ordered else self.total.new_zeros(0)
            dist.all_reduce(partial, group=state.tp_group)
            if state.tp_rank == 0:
                self.total += partial.square().sum()
        else:
            squares = (p.square().sum() for p in self.partial.values())
            self.total += sum(squares, self.total.new_zeros(()))
        total = self.total.reshape(1) / loss_scale**2
        if state.model_parallel_group is not None:
            dist.all_reduce(total, group=state.model_parallel_group)
        if state.dp_group is not None:
            dist.all_reduce(total, group=state.dp_group)
        self.total, self.partial = None, {}
        return total.item() / state.dp_size


class NoiseScale:
    """The smoothed estimates and their ratio (module docstring)."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.grad_squares: float | None = None
        self.trace: float | None = None

    @staticmethod
    def estimates(small: float, small_batch: int, big: float, big_batch: int):
        """(|G|^2, S) from one step's squared norms at the two batch sizes."""
        grad_squares = (big_batch * big - small_batch * small) / (big_batch - small_batch)
        trace = (small - big) / (1.0 / small_batch - 1.0 / big_batch)
        return grad_squares, trace

    def update(self, small: float, small_batch: int, big: float, big_batch: int) -> float:
        """Fold in one step; returns the current B_simple (nan while |G|^2 is not positive)."""
        grad_squares, trace = self.estimates(small, small_batch, big, big_batch)
        if self.grad_squares is None:
            self.grad_squares, self.trace = grad_squares, trace
        else:
            keep = self.decay
            self.grad_squares = keep * self.grad_squares + (1 - keep) * grad_squares
            self.trace = keep * self.trace + (1 - keep) * trace
        return self.trace / self.grad_squares if self.grad_squares > 0 else float("nan")
