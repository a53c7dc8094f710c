"""How the MoE losses (load balancing, router z-loss) reach the gradient: each is attached to a
tensor of the forward (the router's probabilities or logits) by an autograd function that passes
the tensor through and, in backward, gives the loss the gradient `scale.value`, the factor the
step differentiates the micro-batch's main loss with (loss scale x CP size / micro-batches, set
by engine/train/step.py before each schedule). A loss so reaches the gradient once per forward
that builds a graph (with activation recomputation, the recomputed one), on any pipeline stage,
with nothing added to the loss the last stage reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AuxLossScale:
    """The backward factor of the MoE losses: one per model, shared by its routers."""

    value: float = 1.0


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
    return _Attach.apply(tensor, loss, scale)
