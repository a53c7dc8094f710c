"""Block-scaled FP8 weights (`quant_method: fp8`, DeepSeek-V3's published checkpoints and other
"fine-grained FP8" releases), read as the weights they stand for.

A quantized linear weight `<name>` [out, in] is stored in FP8 E4M3 beside
`<name>_scale_inv` [ceil(out / bo), ceil(in / bi)] (fp32), one factor per block of bo x bi
values (`weight_block_size`, DeepSeek-V3's 128 x 128); the weight is value x factor. It is
computed in fp32 and rounded once to bfloat16, as DeepSeek's own conversion to bf16 does.
"""

from __future__ import annotations

import torch

QUANT_METHOD = "fp8"
SCALE = "_scale_inv"


def block_size(quantization: dict) -> tuple[int, int]:
    """The (rows, columns) of one scale's block; ValueError when config.json gives none."""
    size = quantization.get("weight_block_size")
    if not (isinstance(size, list | tuple) and len(size) == 2 and all(int(x) > 0 for x in size)):
        raise ValueError(f"weight_block_size {size!r} is not two positive integers")
    return int(size[0]), int(size[1])


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """The bfloat16 weight of an FP8 weight and its block factors (module docstring)."""
    rows, cols = weight.shape[-2:]
    need = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != need:
        raise ValueError(
            f"scales {list(scale_inv.shape)} do not cover a {[rows, cols]} weight in blocks of "
            f"{list(block)}"
        )
    factors = scale_inv.to(torch.float32)
    factors = factors.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    factors = factors.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * factors).to(torch.bfloat16)
