"""Whether this device runs the FP8 GEMMs a recipe needs: one small product of each kind,
tried before the run builds anything (a GPU before compute capability 8.9 has none). The
block recipes need row-wise scaled products with an fp32 output; where _scaled_mm lacks them,
their products run dequantized (engine/ops/fp8/gemm.py), which any device can."""

from __future__ import annotations

import torch

from engine.errors import ConfigError
from engine.ops.fp8.linear import Fp8Linear
from engine.ops.fp8.quantize import E4M3
from engine.ops.fp8.recipe import Fp8Recipe


def rowwise_fp32_products(device: torch.device) -> bool:
    """Whether torch._scaled_mm multiplies FP8 operands with row-wise scales into fp32 here."""
    a = torch.ones(16, 32, device=device).to(E4M3)
    b = torch.ones(16, 32, device=device).to(E4M3)
    rows, columns = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
    try:
        torch._scaled_mm(a, b.t(), scale_a=rows, scale_b=columns, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_products(device: torch.device) -> bool:
    """Whether torch._scaled_grouped_mm multiplies E4M3 operands here (the experts' grouped
    GEMM, engine/ops/fp8/grouped.py: CUDA devices of compute capability 9.0 or 10.0 in the
    PyTorch versions seen so far; never the CPU)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    a = torch.ones(32, 32, device=device).to(E4M3)
    b = torch.ones(2, 32, 32, device=device).to(E4M3).transpose(1, 2)  # column-major
    scale_a, scale_b = torch.ones(32, device=device), torch.ones(2, 32, device=device)
    ends = torch.tensor([16, 32], dtype=torch.int32, device=device)
    try:
        torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=ends, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def check_fp8_device(recipe: Fp8Recipe, device: torch.device) -> None:
    probe = Fp8Linear(
        Fp8Recipe(recipe.format, "tensorwise" if recipe.per_tensor else recipe.recipe)
    )
    probe.dequantized_blocks = not recipe.per_tensor and not rowwise_fp32_products(device)
    x = torch.randn(32, 128, device=device)
    w = torch.randn(32, 128, device=device)
    try:
        _, scales = probe.forward(x, w)
        _, grad = probe.input_grad(x[:, :32].contiguous(), w, scales)
        probe.weight_grad(x[:, :32].contiguous(), x, scales, grad)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"--fp8-format {recipe.format} --fp8-recipe {recipe.recipe}: this device "
            f"({device}) cannot run the FP8 GEMMs (torch._scaled_mm: {first}); drop the FP8 "
            "flags or use a GPU of compute capability 8.9 or later"
        ) from None
