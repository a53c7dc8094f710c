"""The routed experts' up or down projections in FP8 as one autograd function (--moe-grouped-gemm
with FP8, expert tensor parallelism 1, no biases; engine/model/moe/experts.py): each expert's
tokens and weight quantised by its own linear's Fp8Linear (its scales, its delayed-scaling
state), the forward's products of all experts as one grouped GEMM, the backward's per expert.

The grouped GEMM is torch._scaled_grouped_mm (one kernel for every expert, on the CUDA devices
that run it: engine/ops/fp8/probe.py) where every operand is E4M3 with one scale per tensor
(tensorwise and delayed scaling), the output bf16 and K and N multiples of 16:
the tokens of all experts stacked [T, K] with each row's scale (its expert's), the weights
[E, K, N] column-major with each column's (its expert's), the experts' row ends as offsets.
Elsewhere (the CPU, the block recipes, other shapes) it is each expert's FP8 GEMM in turn,
which is what the per-expert path computes: the same products.

The backward runs each expert's dX and dW GEMMs (Fp8Linear.input_grad and weight_grad; dW as
an ordinary GEMM with --no-fp8-wgrad), dW into the weight's main_grad as
parallel/tensor_parallel/linear_function.py does.
"""

from __future__ import annotations

import torch

from engine.ops.fp8.gemm import fp8_gemm
from engine.ops.fp8.quantize import E4M3, Quantized
from parallel.comm import group_size
from parallel.tensor_parallel.linear_function import fusable, weight_grad


def _one_kernel(a_parts: list[Quantized], b_parts: list[Quantized], out_dtype) -> bool:
    """Whether torch._scaled_grouped_mm runs these products, on a device that has it
    (engine/ops/fp8/probe.py's grouped_products; module docstring)."""
    operands = a_parts + b_parts
    k, n = b_parts[0].data.shape[1], b_parts[0].data.shape[0]
    return (
        sum(a.data.shape[0] for a in a_parts) > 0
        and out_dtype == torch.bfloat16
        and all(q.data.dtype == E4M3 and q.per_tensor for q in operands)
        and k % 16 == 0
        and n % 16 == 0
    )


def grouped_arguments(a_parts: list[Quantized], b_parts: list[Quantized]) -> tuple:
    """(A [T, K], B [E, K, N] column-major, A's row scales [T], B's column scales [E, N],
    the experts' row ends [E] int32): torch._scaled_grouped_mm's operands for the products
    a_e b_e^T of every expert e (inverse scales: the products' factors)."""
    rows = [a.data.shape[0] for a in a_parts]
    device = b_parts[0].data.device
    stacked = torch.cat([a.data.view(torch.uint8) for a in a_parts]).view(E4M3)
    weights = torch.stack([b.data.view(torch.uint8) for b in b_parts]).view(E4M3)
    n = b_parts[0].data.shape[0]
    scale_a = torch.cat(
        [a.scale_inv.reshape(1).expand(r) for a, r in zip(a_parts, rows, strict=True)]
    )
    scale_b = torch.stack([b.scale_inv.reshape(1).expand(n) for b in b_parts])
    ends = torch.tensor(rows, device=device).cumsum(0).to(torch.int32)
    return (
        stacked,
        weights.transpose(1, 2),
        scale_a.float().contiguous(),
        scale_b.float().contiguous(),
        ends,
    )


def grouped_fp8_gemm(
    a_parts: list[Quantized],
    b_parts: list[Quantized],
    out_dtype: torch.dtype,
    kernel: bool = False,
    dequantized: bool = False,
) -> torch.Tensor:
    """[a_e b_e^T for each expert e] stacked along the rows ([T, N]); `kernel`: the device
    runs torch._scaled_grouped_mm (engine/ops/fp8/probe.py's grouped_products)."""
    if kernel and _one_kernel(a_parts, b_parts, out_dtype):
        *operands, ends = grouped_arguments(a_parts, b_parts)
        return torch._scaled_grouped_mm(*operands, offs=ends, out_dtype=out_dtype)
    products = [
        fp8_gemm(a, b, out_dtype, dequantized_blocks=dequantized)
        for a, b in zip(a_parts, b_parts, strict=True)
    ]
    return torch.cat(products)


class _GroupedFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, linears, record, *weights):
        ctx.counts, ctx.linears = counts, linears
        ctx.fused = [
            weight if linear.gradient_accumulation_fusion and fusable(weight) else None
            for linear, weight in zip(linears, weights, strict=True)
        ]
        a_parts, w_parts, ctx.scales = [], [], []
        for linear, part, weight in zip(linears, x.split(counts), weights, strict=True):
            a, w, scales = linear.fp8.forward_operands(part, weight, record)
            a_parts.append(a)
            w_parts.append(w)
            ctx.scales.append(scales)
        ctx.save_for_backward(x, *weights)
        fp8 = linears[0].fp8
        return grouped_fp8_gemm(
            a_parts, w_parts, x.dtype, fp8.grouped_kernel, fp8.dequantized_blocks
        )

    @staticmethod
    def backward(ctx, grad_output):
        x, *weights = ctx.saved_tensors
        inputs, weight_grads = [], []
        pieces = zip(
            ctx.linears,
            grad_output.split(ctx.counts),
            x.split(ctx.counts),
            weights,
            ctx.scales,
            ctx.fused,
            strict=True,
        )
        for linear, grad, part, weight, scales, fused in pieces:
            grad_input, fp8_wgrad = linear.fp8.backward(grad, weight, scales)
            inputs.append(grad_input)
            weight_grads.append(weight_grad(fused, grad, part, fp8_wgrad))
        return (torch.cat(inputs), None, None, None, *weight_grads)


def grouped_fp8_linear(x: torch.Tensor, counts: list[int], linears: list) -> torch.Tensor:
    """x [T, K] (expert e's counts[e] rows after expert e-1's) through each expert's linear
    (`linears`: ColumnParallelLinear / RowParallelLinear modules with an `fp8`, TP 1, no
    bias): [T, N]."""
    record = torch.is_grad_enabled()  # (training: delayed scaling's amaxes count)
    weights = [linear.weight for linear in linears]
    return _GroupedFp8Linear.apply(x, tuple(counts), tuple(linears), record, *weights)


def grouped_fp8_fits(linears: list) -> bool:
    """Whether the experts' linears take the grouped function: the engine's own FP8 GEMMs
    (not torchao's), no biases, no tensor parallelism within an expert."""
    from engine.ops.fp8.linear import Fp8Linear

    first = linears[0]
    return type(first.fp8) is Fp8Linear and first.bias is None and group_size(first.tp_group) == 1
