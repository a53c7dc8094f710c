"""FP8 put on a built model: every column- and row-parallel linear of the transformer layers
runs its GEMMs in FP8 (engine/ops/fp8/linear.py), except the first --num-layers-at-start-in-bf16
and the last --num-layers-at-end-in-bf16 layers with --first-last-layers-bf16 (counted over
the whole model, as megatron-core counts them, whatever the pipeline stage). The embedding,
the output layer and the final norm stay in the model's precision, as in megatron-core.

An MoE layer's routed experts run in FP8 too (each expert its own GEMMs and scales, as
Transformer Engine's grouped linear keeps one per expert), the router in the model's
precision. An FP8 linear's tensorwise amaxes are reduced over its own tensor-parallel group
(the expert tensor-parallel group for an expert's), and delayed scaling's step amaxes over the
ranks that hold the same weight: TP x DP x CP for the dense layers, expert TP x expert DP for
the experts (`delayed_states(chunks, experts=...)`; under expert parallelism the ranks of a
data-parallel group hold different experts).
"""

from __future__ import annotations

import torch

from engine.ops.fp8.delayed import DelayedScaling
from engine.ops.fp8.linear import Fp8Linear
from engine.ops.fp8.probe import grouped_products, rowwise_fp32_products
from engine.ops.fp8.recipe import Fp8Recipe
from parallel.expert_parallel.params import is_expert_parallel
from parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def fp8_recipe(runtime) -> Fp8Recipe:
    """The recipe of a RuntimeConfig's FP8 flags (engine/config/fp8.py)."""
    return Fp8Recipe(
        format=runtime.fp8,
        recipe=runtime.fp8_recipe,
        margin=runtime.fp8_margin,
        amax_history_len=runtime.fp8_amax_history_len,
        amax_compute_algo=runtime.fp8_amax_compute_algo,
        wgrad=runtime.fp8_wgrad,
    )


def in_high_precision(layer_number: int, num_layers: int, at_start: int, at_end: int) -> bool:
    return layer_number < at_start or layer_number >= num_layers - at_end


def enable_fp8(
    chunks,
    recipe: Fp8Recipe,
    num_layers: int,
    keep: tuple[int, int],
    param_gather: bool = False,
    backend: str = "native",
) -> bool:
    """FP8 on each chunk's (a GPTModel's) transformer layers but those `keep` = (at start,
    at end) in high precision; `param_gather` (--fp8-param-gather): their weights marked to
    be gathered in FP8 by the distributed optimizer (parallel/data_parallel/fp8_gather.py);
    `backend` torchao: the GEMMs through torchao (engine/ops/fp8/torchao_linear.py). Returns
    whether the block recipe's products run dequantized on this device (probe.py)."""
    make = Fp8Linear
    if backend == "torchao":
        from engine.ops.fp8.torchao_linear import torchao_linear as make
    device = next(chunks[0].parameters()).device
    dequantized = not recipe.per_tensor and not rowwise_fp32_products(device)
    grouped = recipe.per_tensor and grouped_products(device)
    for model in chunks:
        for layer in model.layers.values():
            if in_high_precision(layer.layer_number, num_layers, *keep):
                continue
            for module in layer.modules():
                if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                    device = module.weight.device
                    delayed = DelayedScaling(recipe, device) if recipe.recipe == "delayed" else None
                    module.fp8 = make(recipe, delayed, module.tp_group)
                    module.fp8.dequantized_blocks = dequantized
                    module.fp8.grouped_kernel = grouped
                    if param_gather:
                        module.weight.fp8_gather = module.fp8
    return dequantized


def fp8_on_the_model(chunks, runtime, num_layers: int, rank: int) -> None:
    """The FP8 flags of a RuntimeConfig put on a run's model chunks (before the data-parallel
    wrappers see them), saying once where the block products run dequantized."""
    recipe = fp8_recipe(runtime)
    keep, gather = runtime.fp8_kept_layers(), runtime.fp8_param_gather
    dequantized = enable_fp8(chunks, recipe, num_layers, keep, gather, runtime.fp8_backend)
    if dequantized and rank == 0:
        print(
            f"fp8: {recipe.recipe}: this device's torch._scaled_mm has no row-wise products "
            "into fp32; the block products run as fp32 GEMMs of the dequantized FP8 operands "
            "(the same values, not FP8's speed)",
            flush=True,
        )


def fp8_layers(chunks) -> list[tuple[torch.nn.Parameter, Fp8Linear]]:
    """(weight, its Fp8Linear) of every FP8 linear of the chunks (modules, or wrappers with a
    `module`), in a fixed order."""
    out = []
    for chunk in chunks:
        for module in getattr(chunk, "module", chunk).modules():
            if getattr(module, "fp8", None) is not None:
                out.append((module.weight, module.fp8))
    return out


def delayed_states(chunks, experts: bool | None = None) -> list[DelayedScaling]:
    """The delayed-scaling states of the chunks' FP8 linears: all, or only the routed experts'
    (experts=True) or only the others' (False)."""
    return [
        fp8.delayed
        for weight, fp8 in fp8_layers(chunks)
        if fp8.delayed is not None and experts in (None, is_expert_parallel(weight))
    ]
