"""FP8 GEMMs: a @ b^T of two quantised [M, K] and [N, K] operands, through torch._scaled_mm (a
real FP8 matrix product: on CPUs in PyTorch >= 2.7 as on GPUs of compute capability >= 8.9).

One scale per operand: one call. Scales per block along K (blockwise's 1 x 128 and
128 x 128, MX's 1 x 32): the product is the sum over K's blocks of row- and column-scaled
products, each one call with one scale per row of a and per row of b (the row-wise
_scaled_mm), added in fp32. Hardware with native block-scaled GEMMs does this in one kernel;
the values are the same products, only the order of the fp32 additions differs.
"""

from __future__ import annotations

import torch

from engine.ops.fp8.quantize import Quantized, expand


def _scaled_mm(a, b_t, scale_a, scale_b, out_dtype):
    return torch._scaled_mm(a, b_t, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def fp8_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T ([M, N]) from a [M, K] and b [N, K]."""
    m, k = a.data.shape
    n = b.data.shape[0]
    if a.block == (m, k) and b.block == (n, k):  # one scale each
        one = (a.scale_inv.reshape(()), b.scale_inv.reshape(()))
        return _scaled_mm(a.data, b.data.t(), *one, out_dtype)
    width = min(a.block[1], b.block[1])
    if a.block[1] % width or b.block[1] % width:
        raise ValueError(f"blocks {a.block} and {b.block} do not share a width along K")
    rows_a = expand(a.scale_inv, (a.block[0], 1), (m, a.scale_inv.shape[1]))
    rows_b = expand(b.scale_inv, (b.block[0], 1), (n, b.scale_inv.shape[1]))
    out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for start in range(0, k, width):
        part = slice(start, min(start + width, k))
        scale_a = rows_a[:, start // a.block[1]].reshape(m, 1).contiguous()
        scale_b = rows_b[:, start // b.block[1]].reshape(1, n).contiguous()
        a_part, b_part = a.data[:, part].contiguous(), b.data[:, part].contiguous()
        out += _scaled_mm(a_part, b_part.t(), scale_a, scale_b, torch.float32)
    return out.to(out_dtype)
