"""A linear layer's three GEMMs in FP8 (parallel/tensor_parallel/linear_function.py calls these
when the layer has an `fp8`): y = x W^T forward, dx = dY W and dW = dY^T x backward, each
operand quantised as the recipe says for its role (engine/ops/fp8/recipe.py) along the GEMM's
reduction dimension, the product through torch._scaled_mm (engine/ops/fp8/gemm.py) in the
activations' dtype (dW in fp32, for the fp32 gradient buffers).

Under tensor parallelism a per-tensor current scale (tensorwise) is taken from the amax of the
whole tensor, all-reduced (MAX) over the TP group, so that a weight's shards, a row-parallel
layer's input shards and a column-parallel layer's gradient shards are scaled as one process
scales the full tensor (Transformer Engine scales a shard by its own amax); block scales are
the block's own (the same blocks as one process's where the shards' edges fall on blocks').
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.ops.fp8.delayed import DelayedScaling
from engine.ops.fp8.gemm import fp8_gemm
from engine.ops.fp8.quantize import CURRENT, Quantized, quantize, scale_from_amax
from engine.ops.fp8.recipe import Fp8Recipe
from parallel.comm import all_reduce


class Fp8Linear:
    """One layer's FP8 settings: its recipe, its delayed-scaling state (delayed recipe) and
    the TP group its tensorwise amaxes are reduced over."""

    def __init__(self, recipe: Fp8Recipe, delayed: DelayedScaling | None = None, tp_group=None):
        self.recipe, self.delayed, self.tp_group = recipe, delayed, tp_group

    def quantize(self, x: torch.Tensor, role: str, record: bool = False) -> Quantized:
        recipe, dtype = self.recipe, self.recipe.dtype(role)
        if recipe.recipe == "delayed":
            if record:
                self.delayed.record(role, x)
            return quantize(x, dtype, scale=self.delayed.scale_of(role))
        if recipe.recipe == "tensorwise":
            amax = x.detach().abs().amax().float()
            all_reduce(amax, self.tp_group, op=dist.ReduceOp.MAX)
            return quantize(x, dtype, scale=scale_from_amax(amax, dtype, CURRENT))
        return quantize(x, dtype, recipe.block(role), recipe.rule)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, record: bool = True) -> torch.Tensor:
        """x [M, K] W^T ([N, K]); `record`: the amaxes count for delayed scaling (training;
        not evaluation, which runs without gradients: the caller decides, as the forward of
        an autograd Function always runs without them)."""
        a = self.quantize(x, "input", record=record)
        return fp8_gemm(a, self.quantize(weight, "weight", record=record), x.dtype)

    def input_grad(self, grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """dY [M, N] W ([N, K])."""
        a = self.quantize(grad_output, "grad", record=True)
        return fp8_gemm(a, self.quantize(weight.t(), "weight"), grad_output.dtype)

    def weight_grad(self, grad_output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dY^T x ([N, K], fp32) (--no-fp8-wgrad: the caller's usual GEMM instead)."""
        a = self.quantize(grad_output.t(), "grad")
        return fp8_gemm(a, self.quantize(x.t(), "input"), torch.float32)
