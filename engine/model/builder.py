"""Build the model chunks this rank holds for a parallel layout."""

from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.model.context import BuildContext
from engine.model.gpt import GPTModel
from parallel.pipeline.layout import stage_layers, virtual_stage
from parallel.random import RNGStatesTracker
from parallel.state import ParallelState


def build_model_chunks(
    config: ModelConfig,
    state: ParallelState,
    *,
    params_dtype: torch.dtype = torch.float32,
    seed: int = 1234,
    sequence_parallel: bool = False,
    gradient_accumulation_fusion: bool = True,
    tracker: RNGStatesTracker | None = None,
    virtual_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    stage_counts: tuple[int, ...] | None = None,
    ops=None,
    torch_compile: bool = False,
    cp_comm_type: tuple[str, ...] | list[str] = ("p2p",),
    times=None,
    placement: str = "loop",
) -> list[GPTModel]:
    """One GPTModel per (virtual) pipeline stage of this rank, in execution order. `ops` is
    the op set from engine.ops.select_ops (the PyTorch ops by default). `torch_compile`
    (--torch-compile) compiles each transformer layer's forward with torch.compile; the
    layer's module call, and so the data-parallel hooks around it, stay eager.
    `cp_comm_type` (--cp-comm-type): context-parallel attention's exchange, for every layer or
    one per layer. `times` (parallel.timing.StepTimes): the layers count their tensor-parallel
    communication there. `placement`: where each chunk sits in the model
    (parallel/pipeline/layout.py: "loop", or "v" for the zb-v schedule). `stage_counts`: each
    pipeline chunk's layers where a layout places them (ParallelConfig.stage_counts)."""
    ctx = BuildContext(
        config,
        tp_group=state.tp_group,
        tp_size=state.tp_size,
        sequence_parallel=sequence_parallel and state.tp_size > 1,
        cp_group=state.cp_group,
        cp_size=state.cp_size,
        cp_rank=state.cp_rank,
        cp_comm_type=tuple(cp_comm_type),
        dp_cp_group=state.dp_cp_group,
        ep_group=state.ep_group,
        ep_size=state.ep_size,
        ep_rank=state.ep_rank,
        expert_tp_group=state.expert_tp_group,
        expert_tp_size=state.etp_size,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        tracker=tracker,
        params_dtype=params_dtype,
        device=state.device,
        seed=seed,
        times=times,
    )
    if ops is not None:
        ctx.ops = ops
    layers = stage_layers(
        config.num_layers,
        state.pp_size,
        state.pp_rank,
        virtual_size,
        first_stage_layers,
        last_stage_layers,
        placement,
        stage_counts,
    )
    chunks = []
    for index, numbers in enumerate(layers):
        stage = virtual_stage(placement, state.pp_size, state.pp_rank, index)
        pre, post = stage == 0, stage == state.pp_size * virtual_size - 1
        chunks.append(
            GPTModel(
                config,
                ctx,
                tp_rank=state.tp_rank,
                pre_process=pre,
                post_process=post,
                layer_numbers=numbers,
            )
        )
    if torch_compile:
        for chunk in chunks:
            for layer in chunk.layers.values():
                layer.forward = torch.compile(layer.forward)
    return chunks
