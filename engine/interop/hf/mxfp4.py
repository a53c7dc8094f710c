"""gpt-oss's MXFP4 experts (OpenAI's published checkpoints), read as the weights they stand for.

An MXFP4 tensor `<name>` is stored as `<name>_blocks` [..., rows, G, 16] (uint8: two 4-bit
values per byte, the low nibble first) and `<name>_scales` [..., rows, G] (uint8: one power of
two per block of 32 values, stored with a bias of 127). A 4-bit value is FP4 E2M1: a sign, two
exponent bits and one mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives). The
weight is value x 2^(scale - 127), exact in bfloat16, laid out as transformers' unquantized
GptOssExperts tensor: [..., G x 32, rows] (the last two axes swapped).
"""

from __future__ import annotations

import torch

QUANT_METHOD = "mxfp4"
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCKS, SCALES = "_blocks", "_scales"


def fp4_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 FP4 E2M1 values by their 4-bit code (the sign is the high bit)."""
    return torch.tensor(_E2M1 + tuple(-x for x in _E2M1), dtype=dtype)


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The weight's shape from its blocks' [..., rows, G, 16]."""
    *prefix, rows, groups, width = blocks_shape
    return (*prefix, groups * width * 2, rows)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weight of an MXFP4 tensor (module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("MXFP4 blocks and scales are uint8")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}")
    table = fp4_values()
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., rows, G, 32]
    exponents = scales.to(torch.int32) - 127
    weight = torch.ldexp(values, exponents[..., None].to(torch.float32))
    weight = weight.flatten(-2)  # [..., rows, G x 32]
    return weight.transpose(-1, -2).to(torch.bfloat16).contiguous()
