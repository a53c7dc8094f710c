"""Recomputation that frees a function's outputs rather than its internals: the outputs are
used in forward, their memory is given back once their consumer has run, and they are
recomputed in place just before the consumer's backward reads them (megatron-core's
"output-discarding" checkpoint, its CheckpointWithoutOutput, written here).

    discarding = OutputDiscarding()
    q, k, v = discarding.run(up_projection, latent_q, latent_kv)  # no graph kept inside
    out = attention(q, k, v)       # saves q, k, v for its backward
    discarding.discard(out)        # q, k, v's storage freed now; refilled before out's
                                   # gradient flows into attention's backward

Only `function`'s inputs are kept. Whatever the consumer saved that shares the outputs'
storage (the tensors themselves or views of them) sees the recomputed values, as the storage is
refilled byte for byte; what it saved as copies is untouched (and then nothing is saved). The
function must be deterministic and draw no random numbers (an up projection is).
"""

from __future__ import annotations

import torch


class _Run(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, state, *args):
        ctx.state = state
        ctx.save_for_backward(*args)
        state.ctx = ctx
        with torch.no_grad():
            outputs = function(*args)
        return outputs if isinstance(outputs, tuple) else (outputs,)

    @staticmethod
    def backward(ctx, *grads):
        inputs, outputs = ctx.state.recomputed
        ctx.state.recomputed = None
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


class OutputDiscarding:
    """One use: run(), then discard() after the outputs' consumer (module docstring)."""

    def __init__(self):
        self.function = None
        self.ctx = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.recomputed = None

    def run(self, function, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.function = function
        self.outputs = _Run.apply(function, self, *args)
        return self.outputs

    def discard(self, consumer_output: torch.Tensor) -> None:
        """Free the outputs' storage; recompute them when `consumer_output`'s gradient
        arrives (before its producer's backward runs)."""
        for output in self.outputs:
            output.untyped_storage().resize_(0)
        if consumer_output.requires_grad:
            consumer_output.register_hook(self._recompute)

    def _recompute(self, grad: torch.Tensor) -> None:
        saved = self.ctx.saved_tensors
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in saved]
        with torch.enable_grad():
            recomputed = self.function(*inputs)
        recomputed = recomputed if isinstance(recomputed, tuple) else (recomputed,)
        for output, fresh in zip(self.outputs, recomputed, strict=True):
            storage = output.untyped_storage()
            storage.resize_(fresh.untyped_storage().nbytes())
            storage.copy_(fresh.untyped_storage())
        self.recomputed = (inputs, recomputed)
        self.outputs, self.ctx = (), None
