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

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.ops.fp8.delayed import DelayedScaling
from engine.ops.fp8.gemm import fp8_gemm
from engine.ops.fp8.quantize import CURRENT, Quantized, quantize, scale_from_amax, tensor_amax
from engine.ops.fp8.recipe import Fp8Recipe
from parallel.comm import all_reduce


@dataclass(frozen=True)
class Fp8Scales:
    """The per-tensor scales a forward quantised x and W with (None under the block recipes,
    whose backward makes its blocks' scales again, with no communication): backward quantises
    x^T and W^T with the same scales, bit for bit the forward's values, with no second amax
    reduction over the TP group."""

    input: torch.Tensor | None = None
    weight: torch.Tensor | None = None


class Fp8Linear:
    """One layer's FP8 settings: its recipe, its delayed-scaling state (delayed recipe) and
    the TP group its tensorwise amaxes are reduced over. With --fp8-param-gather the weight's
    scale is the one its FP8 gather took (`gather_scale`; parallel/data_parallel/fp8_gather.py),
    so the forward's quantisation of the weight gives the gathered bytes again."""

    def __init__(self, recipe: Fp8Recipe, delayed: DelayedScaling | None = None, tp_group=None):
        self.recipe, self.delayed, self.tp_group = recipe, delayed, tp_group
        self.gathered_scale: torch.Tensor | None = None
        self.gathered_amax: torch.Tensor | None = None  # (delayed scaling's, at the gather)
        self.weight_block = recipe.block("weight")  # (None: one scale per tensor)
        # the device has no row-wise scaled products with an fp32 output: block recipes'
        # products run dequantized (engine/ops/fp8/gemm.py; set by engine/ops/fp8/apply.py)
        self.dequantized_blocks = False
        # the device runs torch._scaled_grouped_mm (an expert's linear: engine/ops/fp8/grouped.py)
        self.grouped_kernel = False

    def gather_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The weight's scale for its FP8 gather from the whole weight's amax: delayed
        scaling's (which records the amax, as the forward records it otherwise), or, for
        tensorwise and a delayed history without a weight amax yet, the amax's own; under
        blockwise, one per block from the blocks' amaxes (which the forward makes again from
        the gathered values: parallel/data_parallel/fp8_gather.py)."""
        if self.weight_block is not None:
            return scale_from_amax(amax, self.recipe.dtype("weight"), self.recipe.rule)
        if self.delayed is not None:
            self.gathered_amax = amax.clone()
            self.delayed.record_amax("weight", amax)
            delayed = self.delayed.scale_of("weight")
            if delayed is not None:
                self.gathered_scale = delayed.float().reshape(1, 1).clone()
                return self.gathered_scale
        self.gathered_scale = scale_from_amax(amax, self.recipe.dtype("weight"), CURRENT)
        self.gathered_scale = self.gathered_scale.reshape(1, 1)
        return self.gathered_scale

    def weight_unchanged(self) -> None:
        """The optimizer skipped its step: the gathered weight stays, and under delayed
        scaling its amax counts for the next step, as the forward would record it without
        the FP8 gather."""
        if self.delayed is not None and self.gathered_amax is not None:
            self.delayed.record_amax("weight", self.gathered_amax)

    def quantize(
        self, x: torch.Tensor, role: str, record: bool = False, scale: torch.Tensor | None = None
    ) -> Quantized:
        """x as `role` (input, weight, grad) by the recipe; `scale`: a per-tensor scale made
        before (Fp8Scales) used as it is; `record`: its amax counts for delayed scaling."""
        recipe, dtype = self.recipe, self.recipe.dtype(role)
        if scale is not None:
            return quantize(x, dtype, scale=scale)
        if recipe.recipe == "delayed":
            if record:
                self.delayed.record(role, x)
            delayed = self.delayed.scale_of(role)
            if delayed is not None:
                return quantize(x, dtype, scale=delayed)
        if recipe.per_tensor:  # tensorwise, or delayed without an amax yet: the tensor's own
            amax = tensor_amax(x)
            all_reduce(amax, self.tp_group, op=dist.ReduceOp.MAX)
            return quantize(x, dtype, scale=scale_from_amax(amax, dtype, CURRENT))
        return quantize(x, dtype, recipe.block(role), recipe.rule)

    def forward_operands(
        self, x: torch.Tensor, weight: torch.Tensor, record: bool = True
    ) -> tuple[Quantized, Quantized, Fp8Scales]:
        """x [M, K] and W [N, K] quantised for the forward GEMM, and the scales backward
        reuses; `record`: the amaxes count for delayed scaling (training; not evaluation,
        which runs without gradients: the caller decides, as the forward of an autograd
        Function always runs without them)."""
        a = self.quantize(x, "input", record=record)
        gathered = self.gathered_scale  # (recorded at the gather)
        w = self.quantize(weight, "weight", record=record and gathered is None, scale=gathered)
        scales = Fp8Scales(a.scale, w.scale) if self.recipe.per_tensor else Fp8Scales()
        return a, w, scales

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, record: bool = True
    ) -> tuple[torch.Tensor, Fp8Scales]:
        """(x [M, K] W^T ([N, K]), the scales backward reuses) (forward_operands)."""
        a, w, scales = self.forward_operands(x, weight, record)
        return fp8_gemm(a, w, x.dtype, dequantized_blocks=self.dequantized_blocks), scales

    def input_grad(
        self, grad_output: torch.Tensor, weight: torch.Tensor, scales: Fp8Scales
    ) -> tuple[torch.Tensor, Quantized]:
        """(dY [M, N] W ([N, K]), dY quantised, which weight_grad reuses)."""
        grad = self.quantize(grad_output, "grad", record=True)
        w_t = self.quantize(weight.t(), "weight", scale=scales.weight)
        out = fp8_gemm(grad, w_t, grad_output.dtype, dequantized_blocks=self.dequantized_blocks)
        return out, grad

    def backward(
        self, grad_output: torch.Tensor, weight: torch.Tensor, scales: Fp8Scales
    ) -> tuple[torch.Tensor, Callable | None]:
        """(dY [M, N] W, the weight-gradient product (dY, x) -> dW in FP8 reusing dY's
        quantisation, or None under --no-fp8-wgrad: the caller's usual GEMM)."""
        grad_input, grad = self.input_grad(grad_output, weight, scales)
        if not self.recipe.wgrad:
            return grad_input, None
        return grad_input, functools.partial(self.weight_grad, scales=scales, grad=grad)

    def weight_grad(
        self,
        grad_output: torch.Tensor,
        x: torch.Tensor,
        scales: Fp8Scales,
        grad: Quantized | None = None,
    ) -> torch.Tensor:
        """dY^T x ([N, K], fp32); `grad`: input_grad's dY, transposed where the recipe scales
        per tensor (its blocks would run along the wrong dimension otherwise)."""
        if grad is not None and self.recipe.per_tensor:
            grad_t = grad.transposed()
        else:
            grad_t = self.quantize(grad_output.t(), "grad")
        x_t = self.quantize(x.t(), "input", scale=scales.input)
        return fp8_gemm(grad_t, x_t, torch.float32, dequantized_blocks=self.dequantized_blocks)
