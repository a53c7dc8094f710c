"""How the MoE losses (load balancing, router z-loss) and multi-token prediction's losses reach
the gradient: each is attached to a tensor of the forward (the router's probabilities or
logits; the main token losses) by an autograd function that passes the tensor through and, in
backward, gives the loss the gradient `scale.factor()`, the factor the step differentiates the
micro-batch's main loss with (loss scale x CP size / micro-batches, set by
engine/train/step.py before each schedule; under --calculate-per-token-loss divided by the
global batch's token count, as the main loss's sum is). A loss so reaches the gradient once per
forward that builds a graph (with activation recomputation, the recomputed one), on any
pipeline stage, with nothing added to the loss the last stage reports.

Under --calculate-per-token-loss (`per_token`) each MoE loss is first multiplied by the rows of
the tensor it is attached to (the tokens the router saw on this rank), as megatron-core's
router does, so that once the step divides everything by the global batch's token count the MoE
losses weigh what they weigh without the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class AuxLossScale:
    """The backward factor of the side losses (module docstring): one per model, shared by
    its routers and its multi-token prediction, set by each step."""

    step_factor: float = 1.0  # the main loss's factor: loss scale x CP size / micro-batches
    token_count: float | None = None  # --calculate-per-token-loss: the global batch's count

    @property
    def per_token(self) -> bool:
        """--calculate-per-token-loss (an MoE loss then times its router's rows)."""
        return self.token_count is not None

    def factor(self) -> float:
        """The factor of a loss that is a sum over tokens with --calculate-per-token-loss (the
        step then divides by the global batch's token count), a mean over them without."""
        if self.token_count is None:
            return self.step_factor
        return self.step_factor / self.token_count


class _Attach(torch.autograd.Function):
    """Passes `tensor` through; in backward gives `loss` the gradient factor(), read then
    (the step sets it before each schedule)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, loss: torch.Tensor, factor: Callable[[], float]):
        ctx.save_for_backward(loss)
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.factor()), None


def attach_loss(tensor: torch.Tensor, loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
    """`tensor`, carrying the MoE loss `loss` into the gradient (module docstring)."""
    if scale.per_token:
        loss = loss * tensor.shape[0]
    return _Attach.apply(tensor, loss, scale.factor)


def attach_side_loss(tensor: torch.Tensor, loss: torch.Tensor, scale: AuxLossScale):
    """`tensor`, carrying a side loss (multi-token prediction's, already a sum over tokens
    under --calculate-per-token-loss) into the gradient with `scale.factor()`."""
    return _Attach.apply(tensor, loss, scale.factor)
