"""FP8 GEMMs: a @ b^T of two quantised [M, K] and [N, K] operands, through torch._scaled_mm (a
real FP8 matrix product: on CPUs in PyTorch >= 2.7 as on GPUs of compute capability >= 8.9).

One scale per operand: one call. Scales per block along K (blockwise's 1 x 128 and
128 x 128, MX's 1 x 32): the product is the sum over K's blocks of row- and column-scaled
products, each one call with one scale per row of a and per row of b (the row-wise
_scaled_mm), added in fp32. Hardware with native block-scaled GEMMs does this in one kernel;
the values are the same products, only the order of the fp32 additions differs.

Where _scaled_mm has no row-wise products with an fp32 output (CUDA's, in the PyTorch versions
seen so far), `dequantized_blocks` computes the block-scaled product as an fp32 GEMM of the
dequantized operands instead: the block recipes' scales are powers of 2, so each dequantized
value (an FP8 value times its block's scale) is exact in fp32 (and in TF32: 3 mantissa bits),
and the product is the same up to the order of the fp32 additions; FP8's speed is not had.

CUDA's _scaled_mm takes K and N in multiples of 16: there the operands are padded with zeros
(which add nothing) and the output cut back; an expert's weight gradient, whose K is the
number of tokens routed to it, needs this. Empty operands (an expert without tokens) give zeros.
"""

from __future__ import annotations

import torch

from engine.ops.fp8.quantize import Quantized, expand


def _scaled_mm(a, b_t, scale_a, scale_b, out_dtype):
    return torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _padded(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """FP8 data [r, c] with zeros after it to [rows, cols] (FP8's zero is the byte 0)."""
    if data.shape == (rows, cols):
        return data
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=data.device)
    out[: data.shape[0], : data.shape[1]] = data.view(torch.uint8)
    return out.view(data.dtype)


def fp8_gemm(
    a: Quantized,
    b: Quantized,
    out_dtype: torch.dtype,
    align: int | None = None,
    dequantized_blocks: bool = False,
) -> torch.Tensor:
    """a @ b^T ([M, N]) from a [M, K] and b [N, K]; `align`: K and N padded to multiples of it
    (default 16 on CUDA, 1 elsewhere); `dequantized_blocks`: block-scaled operands multiplied
    dequantized (module docstring)."""
    m, k = a.data.shape
    n = b.data.shape[0]
    if 0 in (m, n, k):
        return torch.zeros(m, n, dtype=out_dtype, device=a.data.device)
    per_tensor = a.per_tensor and b.per_tensor
    if dequantized_blocks and not per_tensor:
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
    align = align or (16 if a.data.is_cuda else 1)
    wide_k, wide_n = -(-k // align) * align, -(-n // align) * align
    a_data, b_data = _padded(a.data, m, wide_k), _padded(b.data, wide_n, wide_k)
    if per_tensor:  # one scale each
        one = (a.scale_inv.reshape(()), b.scale_inv.reshape(()))
        return _scaled_mm(a_data, b_data.t(), *one, out_dtype)[:, :n]
    width = min(a.block[1], b.block[1])
    if a.block[1] % width or b.block[1] % width:
        raise ValueError(f"blocks {a.block} and {b.block} do not share a width along K")
    rows_a = expand(a.scale_inv, (a.block[0], 1), (m, a.scale_inv.shape[1]))
    rows_b = expand(b.scale_inv, (b.block[0], 1), (n, b.scale_inv.shape[1]))
    rows_b = torch.cat([rows_b, rows_b.new_ones(wide_n - n, rows_b.shape[1])])
    out = torch.zeros(m, wide_n, dtype=torch.float32, device=a.data.device)
    for start in range(0, k, width):
        part = slice(start, start + -(-min(width, k - start) // align) * align)
        scale_a = rows_a[:, start // a.block[1]].reshape(m, 1).contiguous()
        scale_b = rows_b[:, start // b.block[1]].reshape(1, wide_n).contiguous()
        a_part, b_part = a_data[:, part].contiguous(), b_data[:, part].contiguous()
        out += _scaled_mm(a_part, b_part.t(), scale_a, scale_b, torch.float32)
    return out[:, :n].to(out_dtype)
