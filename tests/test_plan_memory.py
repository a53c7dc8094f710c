"""The planner's count of the parameters each rank holds (engine/planning/memory.py), without
building the model, against the model the engine builds on real gloo ranks: every rank of
each layout, for a GPT-2 style and a Llama style model; and the model state a rank holds
after a training step against the predicted bytes."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
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
DEEPSEEK = ModelConfig(
    num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=32, vocab_size=1000,
    make_vocab_size_divisible_by=16, position_embedding_type="rope", normalization="RMSNorm",
    swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
    qk_layernorm=True, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16,
    qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
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


MTP = dataclasses.replace(DEEPSEEK, mtp_num_layers=2)


@pytest.mark.parametrize(
    "name, cfg", [("gpt2", GPT2), ("llama", LLAMA), ("mla", DEEPSEEK), ("mla-mtp", MTP)]
)
def test_parameters_per_rank_are_counted_exactly(name, cfg):
    # (MLA and MTP: the layouts that split their tensors and place the last stage's extras)
    layouts = LAYOUTS if name in ("gpt2", "llama") else [LAYOUTS[i] for i in (1, 4, 5, 6)]
    for layout in layouts:
        for pp_rank, count in run_ranks(_count, layout.tp * layout.pp, cfg, layout):
            assert count == rank_parameters(cfg, layout, pp_rank), (name, layout, pp_rank)


def _muon_count(rank, world, cfg, layout):
    from engine.model.builder import build_model_chunks
    from engine.optim.muon_with_adam import takes_muon
    from parallel.state import ParallelState

    state = ParallelState.build(layout.tp, layout.pp)
    chunks = build_model_chunks(cfg, state, virtual_size=layout.virtual)
    held = {id(p): p.numel() for c in chunks for p in c.parameters() if takes_muon(p)}
    return state.pp_rank, sum(held.values())


@pytest.mark.parametrize("name, cfg", [("gpt2", GPT2), ("llama", LLAMA), ("mla", DEEPSEEK)])
def test_muons_weights_are_counted_exactly(name, cfg):
    """The planner's count of the weights Muon trains (engine/planning/muon_terms.py) equals
    the built model's (engine/optim/muon_with_adam.py's rule) on every rank."""
    from engine.planning.memory import stage_shape
    from engine.planning.muon_terms import muon_parameters

    for layout in (Layout(tp=1), Layout(tp=2), Layout(tp=2, pp=2)):
        for pp_rank, count in run_ranks(_muon_count, layout.tp * layout.pp, cfg, layout):
            stage = stage_shape(cfg, layout, pp_rank)
            assert count == sum(muon_parameters(cfg, stage, layout.tp)) > 0, (
                name, layout, pp_rank
            )  # fmt: skip


def _state(rank, world, cfg, layout):
    from engine.model.builder import build_model_chunks
    from engine.optim.lr_schedule import LRScheduler
    from engine.optim.optimizer import build_optimizer
    from engine.planning.state_memory import held_state_bytes, live_tensor_bytes
    from engine.train.step import train_step
    from parallel.data_parallel.ddp import DistributedDataParallel
    from parallel.state import ParallelState

    torch.manual_seed(0)
    state = ParallelState.build(layout.tp, layout.pp)
    chunks = build_model_chunks(cfg, state, params_dtype=torch.bfloat16)
    ddps = [DistributedDataParallel(c, state.dp_group, sharding=layout.strategy) for c in chunks]
    ocfg = OptimizerConfig(optimizer=layout.optimizer, lr=1e-4, lr_decay_style="constant")
    optimizer = build_optimizer(
        ddps, ocfg, use_distributed_optimizer=layout.strategy != "no_shard", fp16=False,
        tp_rank=state.tp_rank, model_parallel_group=state.model_parallel_group,
        instance_group=state.optimizer_instance_group, device=state.device,
        tp_group=state.tp_group,
    )  # fmt: skip
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
    batches = [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}]
    train_step(ddps, optimizer, LRScheduler(ocfg, 10), batches, state)
    optimizer.finish_param_sync()
    del tokens, batches
    return held_state_bytes(ddps, optimizer) | {"live": live_tensor_bytes()}


@pytest.mark.parametrize(
    "strategy, optimizer",
    [("no_shard", "adam"), ("optim", "adam"), ("optim_grads", "adam"),
     ("optim_grads_params", "adam"), ("no_shard", "muon"), ("optim_grads_params", "muon")],
)  # fmt: skip
def test_model_state_bytes_after_a_step(strategy, optimizer):
    layout = Layout(tp=2, pp=1, dp=2, strategy=strategy, optimizer=optimizer)
    predicted = rank_state_bytes(LLAMA, layout, 0)
    for held in run_ranks(_state, 4, LLAMA, layout):
        for kind, value in predicted.items():
            assert held[kind] == pytest.approx(value, rel=0.05), (strategy, kind, held, predicted)
        # every tensor alive in the process, whoever holds it: the listed state and little
        # else (RNG states, rotary tables, bookkeeping), so a copy left behind would show
        listed = sum(held[kind] for kind in predicted)
        assert listed <= held["live"] <= 1.05 * listed, (strategy, held)


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
    # multi-latent attention, with and without the query latent (padded values on the CPU)
    "mla": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, hidden_dropout=0.0, multi_latent_attention=True,
                q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
                v_head_dim=24, qk_layernorm=True),
    "mla-no-q-latent": dict(position_embedding_type="rope", normalization="RMSNorm",
                            swiglu=True, add_bias_linear=False, hidden_dropout=0.0,
                            multi_latent_attention=True, kv_lora_rank=64, qk_head_dim=32,
                            qk_pos_emb_head_dim=16, v_head_dim=32),
}  # fmt: skip
TP_LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def _style(name: str) -> ModelConfig:
    return ModelConfig(
        num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=128,
        max_position_embeddings=128, vocab_size=1024, attention_dropout=0.0, **STYLES[name],
    )  # fmt: skip


def _layer_bytes(rank, world, sequence_parallel):
    from engine.planning.saved_activations import measure_layer
    from parallel.state import ParallelState

    state = ParallelState.build(tp=world)
    return {
        name: measure_layer(_style(name), state.tp_group, world, sequence_parallel, 2)
        for name in STYLES
    }


def test_layer_activations_predicted_for_each_style_and_tp_layout():
    """25 layouts: 5 layer styles x (TP 1, 2 and 4, with and without SP); the issue asks 10%,
    the model counts tensor by tensor and is held to 1% (measured: equal on every rank)."""
    from engine.planning.activations import layer_activation_bytes

    for tp, sp in TP_LAYOUTS:
        for measured in run_ranks(_layer_bytes, tp, sp):
            for name, value in measured.items():
                predicted = layer_activation_bytes(_style(name), tp, sp, micro_batch_size=2)
                assert value == pytest.approx(predicted, rel=0.01), (name, tp, sp)  # (equal here)


RECOMPUTE = {
    "none": {},
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full-uniform-3": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=3),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
    "mla_up_proj": dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
    "mla_up_proj+core_attn": dict(recompute_granularity="selective",
                                  recompute_modules=["mla_up_proj", "core_attn"]),
}  # fmt: skip
MLA_ONLY = ("mla_up_proj", "mla_up_proj+core_attn")


def _chunk_style(name: str, recompute: str) -> ModelConfig:
    return ModelConfig(
        num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128,
        max_position_embeddings=128, vocab_size=1024, attention_dropout=0.0,
        **STYLES[name], **RECOMPUTE[recompute],
    )  # fmt: skip


def _chunk_bytes(rank, world, sequence_parallel):
    """What a middle pipeline chunk of 4 layers keeps for one micro-batch of 2 samples."""
    from engine.model.context import BuildContext
    from engine.model.gpt import GPTModel
    from engine.planning.saved_activations import saved_activation_bytes
    from parallel.random import model_parallel_seed
    from parallel.state import ParallelState

    state = ParallelState.build(tp=world)
    sp = sequence_parallel and world > 1
    out = {}
    for name in ("gpt2", "llama", "mla"):
        for recompute in RECOMPUTE:
            if recompute in MLA_ONLY and name != "mla":
                continue
            cfg = _chunk_style(name, recompute)
            tracker = model_parallel_seed(1234, state.tp_rank, 0, state.device, 0)
            ctx = BuildContext(
                cfg, tp_group=state.tp_group, tp_size=world, sequence_parallel=sp,
                params_dtype=torch.bfloat16, tracker=tracker,
            )  # fmt: skip
            model = GPTModel(cfg, ctx, tp_rank=state.tp_rank, pre_process=False,
                             post_process=False).train()  # fmt: skip
            s = cfg.seq_length // world if sp else cfg.seq_length
            x = torch.randn(s, 2, cfg.hidden_size).to(torch.bfloat16).requires_grad_()
            run = functools.partial(model, hidden=x)
            out[name, recompute] = saved_activation_bytes(run, model.parameters())[1]
    return out


def test_a_chunk_of_layers_with_each_recomputation():
    """3 styles (one of them multi-latent attention) x 5 recomputation choices (MLA: 7, its
    up projections freed) x (TP 1, TP 2 with SP): 34 more layouts."""
    from engine.planning.activations import layers_activation_bytes

    for tp, sp in ((1, False), (2, True)):
        for measured in run_ranks(_chunk_bytes, tp, sp):
            for (name, recompute), value in measured.items():
                cfg = _chunk_style(name, recompute)
                predicted = layers_activation_bytes(cfg, 4, tp, sp, micro_batch_size=2)
                assert value == pytest.approx(predicted, rel=0.01), (name, recompute, tp)
