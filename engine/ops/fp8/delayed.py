"""Delayed scaling's state, one per FP8 linear layer: the amaxes of its input x, weight W and
output gradient dY over the last `amax_history_len` steps, and the scales the next step uses.

During a step each quantisation of x, W (forward) and dY (backward) records its amax (the
largest over the step's micro-batches) and uses the scales the step began with. A role whose
history holds no amax yet (the run's first step, or a history of zeros after skipped steps)
is scaled by the tensor's own amax, as the tensorwise recipe does, where Transformer Engine
starts from a scale of 1: with 1, gradients below E5M2's smallest value (1.5e-5) vanish in
the first step, and a layout whose micro-batch losses carry another factor (data parallelism
scales each rank's dY by its DP size) rounds them differently from one process.

At the end of the step (`update_delayed_scales`, before the optimizer) the amaxes of every
layer are all-reduced (MAX) over the tensor-, data- and context-parallel groups, as
megatron-core's amax reduction group, so every layout holds the amaxes one process would
have, and each scale becomes fp8_max / amax / 2^margin, amax the newest (`most_recent`) or the
largest (`max`) in the history; a zero or non-finite amax keeps the scale it had.

Transformer Engine updates after each micro-batch's forward and backward; here the update is
once per step, so a step's scales do not depend on the pipeline schedule's order (and a step
of one micro-batch is the same). The history and scales are saved in checkpoints.
"""

from __future__ import annotations

import torch

from engine.ops.fp8.quantize import FP8_MAX, tensor_amax
from engine.ops.fp8.recipe import Fp8Recipe
from parallel.comm import all_reduce

SLOTS = {"input": 0, "weight": 1, "grad": 2}


class DelayedScaling:
    def __init__(self, recipe: Fp8Recipe, device):
        self.recipe = recipe
        self.history = torch.zeros(recipe.amax_history_len, 3, device=device)
        self.scale = torch.ones(3, device=device)
        self.amax_now = torch.zeros(3, device=device)
        # per role: whether the history holds an amax (None: read from it at the next use,
        # as after a checkpoint was loaded into it); set for every layer at once after each
        # update, one read of the device per step
        self.seen: list[bool] | None = None

    def scale_of(self, role: str) -> torch.Tensor | None:
        """The role's scale, or None while its history holds no amax (module docstring)."""
        if self.seen is None:
            self.seen = (self.history != 0).any(0).tolist()
        return self.scale[SLOTS[role]] if self.seen[SLOTS[role]] else None

    def record(self, role: str, tensor: torch.Tensor) -> None:
        self.record_amax(role, tensor_amax(tensor))

    def record_amax(self, role: str, amax: torch.Tensor) -> None:
        slot = SLOTS[role]
        self.amax_now[slot] = torch.maximum(self.amax_now[slot], amax.reshape(()))

    def update(self, amax: torch.Tensor) -> None:
        """The step's (reduced) amaxes into the history, and the next step's scales; a
        non-finite amax (a step the optimizer skips) enters as 0, keeping the scale."""
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
        self.history = torch.cat([amax[None], self.history[:-1]])
        window = self.history[0] if self.recipe.amax_compute_algo == "most_recent" else (
            self.history.amax(0)
        )  # fmt: skip
        limits = torch.tensor(
            [FP8_MAX[self.recipe.dtype(role)] for role in SLOTS], device=amax.device
        )
        fresh = limits / window / 2.0**self.recipe.margin
        fresh = torch.clamp(fresh, max=torch.finfo(torch.float32).max)
        usable = torch.isfinite(window) & (window > 0)
        self.scale = torch.where(usable, fresh, self.scale)
        self.amax_now = torch.zeros_like(self.amax_now)


def update_delayed_scales(states: list[DelayedScaling], groups) -> None:
    """Every layer's step amaxes reduced (MAX) over `groups` in one tensor, then each updated."""
    if not states:
        return
    amaxes = torch.stack([s.amax_now for s in states])
    for group in groups:
        all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
    for state, amax in zip(states, amaxes, strict=True):
        state.update(amax)
    seen = torch.stack([(s.history != 0).any(0) for s in states]).tolist()
    for state, flags in zip(states, seen, strict=True):
        state.seen = flags
