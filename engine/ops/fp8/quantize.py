"""FP8 quantisation of 2-D tensors, with the scales of each of Megatron-LM's recipes.

A tensor [M, K] is cut into blocks of `block` = (rows, columns) (the whole tensor, a row's 128
or 32 consecutive values, a 128 x 128 tile) and each block is multiplied by its own scale, so
that its largest magnitude lands within the format's range, then cast with saturation (values
beyond the range, which a delayed scale from an earlier step can give, become +-max). The
inverse scales go with the data: `value ~= data * scale_inv`, block by block.

Scales: given (delayed scaling: from earlier steps' amaxes), or from the block's own amax
(current scaling): fp8_max / amax, as is (tensorwise), rounded down to a power of 2
(blockwise, as Transformer Engine's default), or MX's E8M0 scale 2^-ceil(log2(amax /
fp8_max)) (so nothing saturates). A block of zeros gets scale 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
TINY = torch.finfo(torch.float32).tiny

# how a block's scale is made from its amax
CURRENT = "current"  # fp8_max / amax
POWER_OF_TWO = "power_of_two"  # fp8_max / amax rounded down to a power of 2
MX = "mx"  # E8M0: 2^-ceil(log2(amax / fp8_max))


@dataclass(frozen=True)
class Quantized:
    """data [M, K] in FP8, the scales it was made with and their inverses scale_inv, both
    [ceil(M / block[0]), ceil(K / block[1])] in fp32."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    scale: torch.Tensor

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole tensor."""
        return self.block == tuple(self.data.shape)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (
            self.data.to(torch.float32) * expand(self.scale_inv, self.block, self.data.shape)
        ).to(dtype)

    def transposed(self) -> Quantized:
        """The quantisation of the transposed tensor with the transposed blocks: bit for bit
        what quantising x^T by blocks (columns, rows) gives, as each block's amax, scale and
        rounded values do not depend on the layout."""
        return Quantized(
            self.data.t().contiguous(), self.scale_inv.t(), self.block[::-1], self.scale.t()
        )


def block_shape(block: tuple[int, int] | None, shape) -> tuple[int, int]:
    """A block of None: the whole tensor."""
    return (
        (shape[0], shape[1])
        if block is None
        else (min(block[0], shape[0]), min(block[1], shape[1]))
    )


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of x (fp32; 0 for an empty tensor: an expert without tokens)."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    return x.detach().abs().amax().float()


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest magnitude of each block (fp32, [ceil(M / rows), ceil(K / columns)])."""
    rows, cols = block
    m, k = x.shape
    padded = torch.nn.functional.pad(x.abs().float(), (0, -k % cols, 0, -m % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    return blocks.amax(dim=(1, 3))


def expand(per_block: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """Each block's value repeated over its elements ([M, K])."""
    out = per_block.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return out[: shape[0], : shape[1]]


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, rule: str) -> torch.Tensor:
    """The scales (fp32) that bring each amax into the format's range, by `rule`."""
    fp8_max = FP8_MAX[dtype]
    amax = amax.float()
    if rule == MX:
        exponent = torch.ceil(torch.log2(torch.clamp(amax, min=TINY) / fp8_max))
        scale = torch.exp2(-exponent.clamp(-127, 127))
    else:
        scale = fp8_max / torch.clamp(amax, min=TINY)
        scale = torch.clamp(scale, max=torch.finfo(torch.float32).max)
        if rule == POWER_OF_TWO:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int] | None = None,
    rule: str = CURRENT,
    scale: torch.Tensor | None = None,
) -> Quantized:
    """x [M, K] in FP8 by blocks (module docstring); `scale` given: one per-tensor scale used
    as it is (delayed scaling)."""
    block = block_shape(block, x.shape)
    if x.numel() == 0:  # (an expert without tokens: its products are zeros, fp8_gemm)
        ones = torch.ones(1, 1, device=x.device)
        return Quantized(x.to(dtype), ones, block, ones)
    if scale is None:
        scale = scale_from_amax(block_amax(x, block), dtype, rule)
    else:
        scale = scale.float().reshape(1, 1)
    fp8_max = FP8_MAX[dtype]
    whole = block == tuple(x.shape)  # one scale: multiplied in without an [M, K] copy of it
    scaled = x.float() * (scale.reshape(()) if whole else expand(scale, block, x.shape))
    data = torch.clamp(scaled, -fp8_max, fp8_max).to(dtype).contiguous()
    return Quantized(data, 1.0 / scale, block, scale)
