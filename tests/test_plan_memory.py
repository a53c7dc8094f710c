"""The planner's count of the parameters each rank holds (engine/planning/memory.py), without
building the model, against the model the engine builds on real gloo ranks: every rank of
each layout, for a GPT-2 style and a Llama style model; and the model state a rank holds
after a training step against the predicted bytes."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig, OptimizerConfig
from engine.planning.memory import Layout, rank_parameters, rank_state_bytes
from tests.distributed import run_ranks

GPT2 = ModelConfig(
    num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
    max_position_embeddings=48, vocab_size=1000, make_vocab_size_divisible_by=16,
)  # fmt: skip
LLAMA = ModelConfig(
    num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True,
    num_query_groups=4, seq_length=32, vocab_size=1000, make_vocab_size_divisible_by=16,
    position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
)  # fmt: skip
LAYOUTS = [
    Layout(tp=1, pp=1), Layout(tp=2, pp=1), Layout(tp=4, pp=1), Layout(tp=1, pp=2),
    Layout(tp=2, pp=2), Layout(tp=1, pp=4), Layout(tp=1, pp=2, virtual=2),
    Layout(tp=1, pp=2, first_stage_layers=1),
]  # fmt: skip


def _count(rank, world, cfg, layout):
    from engine.model.builder import build_model_chunks
    from parallel.state import ParallelState

    state = ParallelState.build(layout.tp, layout.pp)
    chunks = build_model_chunks(
        cfg,
        state,
        virtual_size=layout.virtual,
        first_stage_layers=layout.first_stage_layers,
    )
    held = {id(p): p.numel() for chunk in chunks for p in chunk.parameters()}
    return state.pp_rank, sum(held.values())


@pytest.mark.parametrize("name, cfg", [("gpt2", GPT2), ("llama", LLAMA)])
def test_parameters_per_rank_are_counted_exactly(name, cfg):
    for layout in LAYOUTS:
        for pp_rank, count in run_ranks(_count, layout.tp * layout.pp, cfg, layout):
            assert count == rank_parameters(cfg, layout, pp_rank), (name, layout, pp_rank)


def _state(rank, world, cfg, layout):
    from engine.model.builder import build_model_chunks
    from engine.optim import LRScheduler, build_optimizer
    from engine.state_memory import held_state_bytes
    from engine.step import train_step
    from parallel.ddp import DistributedDataParallel
    from parallel.state import ParallelState

    torch.manual_seed(0)
    state = ParallelState.build(layout.tp, layout.pp)
    chunks = build_model_chunks(cfg, state, params_dtype=torch.bfloat16)
    ddps = [DistributedDataParallel(c, state.dp_group, sharding=layout.strategy) for c in chunks]
    ocfg = OptimizerConfig(lr=1e-4, lr_decay_style="constant")
    optimizer = build_optimizer(
        ddps, ocfg, use_distributed_optimizer=layout.strategy != "no_shard", fp16=False,
        tp_rank=state.tp_rank, model_parallel_group=state.model_parallel_group,
        world_group=state.world_group, device=state.device,
    )  # fmt: skip
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
    batches = [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}]
    train_step(ddps, optimizer, LRScheduler(ocfg, 10), batches, state)
    optimizer.finish_param_sync()
    return held_state_bytes(ddps, optimizer)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_model_state_bytes_after_a_step(strategy):
    layout = Layout(tp=2, pp=1, dp=2, strategy=strategy)
    predicted = rank_state_bytes(LLAMA, layout, 0)
    for held in run_ranks(_state, 4, LLAMA, layout):
        for kind, value in predicted.items():
            assert held[kind] == pytest.approx(value, rel=0.05), (strategy, kind, held, predicted)


def test_layouts_the_engine_refuses_are_refused():
    from engine.errors import ConfigError

    for layout, pp_rank, match in (
        (Layout(tp=3), 0, "not divisible"),
        (Layout(strategy="zero3"), 0, "sharding strategy 'zero3'"),
        (Layout(pp=1, virtual=2), 0, "virtual pipeline stages need"),
        (Layout(pp=2), 2, "outside 2 stages"),
    ):
        with pytest.raises(ConfigError, match=match):
            rank_parameters(GPT2, layout, pp_rank)


STYLES = {
    "gpt2": dict(hidden_dropout=0.1),  # LayerNorm, GELU, biases, learned positions, dropout
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                  add_bias_linear=False, hidden_dropout=0.0),
    "llama-gqa-qknorm": dict(position_embedding_type="rope", normalization="RMSNorm",
                             swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
                             group_query_attention=True, num_query_groups=4,
                             qk_layernorm=True),
}  # fmt: skip
TP_LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def _style(name: str) -> ModelConfig:
    return ModelConfig(
        num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=128,
        max_position_embeddings=128, vocab_size=1024, attention_dropout=0.0, **STYLES[name],
    )  # fmt: skip


def _layer_bytes(rank, world, sequence_parallel):
    from engine.activation_memory import measure_layer
    from parallel.state import ParallelState

    state = ParallelState.build(tp=world)
    return {
        name: measure_layer(_style(name), state.tp_group, world, sequence_parallel, 2)
        for name in STYLES
    }


def test_layer_activations_predicted_for_each_style_and_tp_layout():
    """15 layouts: 3 layer styles x (TP 1, 2 and 4, with and without SP); the issue asks 10%,
    the model counts tensor by tensor and is held to 1% (measured: equal on every rank)."""
    from engine.planning.activations import layer_activation_bytes

    for tp, sp in TP_LAYOUTS:
        for measured in run_ranks(_layer_bytes, tp, sp):
            for name, value in measured.items():
                predicted = layer_activation_bytes(_style(name), tp, sp, micro_batch_size=2)
                assert value == pytest.approx(predicted, rel=0.01), (name, tp, sp)  # (equal here)
