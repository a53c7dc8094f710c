"""Megatron-LM's FP8 recipes (--fp8-format, --fp8-recipe and their settings) as what each
operand of a linear layer's three GEMMs gets: its FP8 format, its blocks and how their scales
are made (engine/ops/fp8/quantize.py).

Roles: the layer's input x and weight W in the forward GEMM y = x W^T, and the output gradient
dY in the two backward GEMMs dx = dY W and dW = dY^T x. Formats: `e4m3` everywhere, or `hybrid`:
E4M3 forward, E5M2 for dY. Blocks run along each GEMM's reduction dimension:

    delayed     one scale per tensor, from the amaxes of earlier steps (engine/ops/fp8/delayed.py)
    tensorwise  one scale per tensor, from its own amax (current scaling)
    blockwise   DeepSeek-V3's: 1 x 128 tiles of x and dY, 128 x 128 blocks of W; scales rounded
                down to powers of 2 (Transformer Engine's default)
    mxfp8       MX: 1 x 32 blocks of every operand with E8M0 (power-of-2) scales, rounded up
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.ops.fp8.quantize import CURRENT, E4M3, E5M2, MX, POWER_OF_TWO

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FORMATS = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Fp8Recipe:
    format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0  # delayed: scale = fp8_max / amax / 2^margin
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"  # or "max" over the history
    wgrad: bool = True  # False: the weight-gradient GEMM in the activations' precision

    def __post_init__(self):
        if self.format not in FORMATS or self.recipe not in RECIPES:
            raise ValueError(f"FP8 format {self.format!r} / recipe {self.recipe!r} unknown")

    def dtype(self, role: str):
        return E5M2 if role == "grad" and self.format == "hybrid" else E4M3

    def block(self, role: str) -> tuple[int, int] | None:
        """The (rows, columns) of a scale's block, the columns along the reduction dimension
        (None: one scale for the tensor)."""
        if self.recipe == "blockwise":
            return (128, 128) if role == "weight" else (1, 128)
        if self.recipe == "mxfp8":
            return (1, 32)
        return None

    @property
    def rule(self) -> str:
        return {"blockwise": POWER_OF_TWO, "mxfp8": MX}.get(self.recipe, CURRENT)

    @property
    def per_tensor(self) -> bool:
        return self.recipe in ("delayed", "tensorwise")
