"""How the MoE losses (load balancing, router z-loss) reach the gradient: each is attached to a
tensor of the forward (the router's probabilities or logits) by an autograd function that passes
the tensor through and, in backward, gives the loss the gradient `scale.value`, the factor the
step differentiates the micro-batch's main loss with (loss scale x CP size / micro-batches, set
by engine/train/step.py before each schedule). A loss so reaches the gradient once per forward
that builds a graph (with activation recomputation, the recomputed one), on any pipeline stage,
with nothing added to the loss the last stage reports.

Under --calculate-per-token-loss (`per_row`) each loss is first multiplied by the rows of the
tensor it is attached to (the tokens the router saw on this rank), as megatron-core's router
does, so that once the step divides everything by the global batch's token count the MoE
losses weigh what they weigh without the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AuxLossScale:
    """The backward factor of the MoE losses: one per model, shared by its routers."""

    value: float = 1.0
    per_row: bool = False  # --calculate-per-token-loss: times the router's rows (above)


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, loss: torch.Tensor, scale: AuxLossScale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale.value), None


def attach_loss(tensor: torch.Tensor, loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
    """`tensor`, carrying `loss` into the gradient (module docstring)."""
    if scale.per_row:
        loss = loss * tensor.shape[0]
    return _Attach.apply(tensor, loss, scale)
