"""Megatron-LM mixture-of-experts checkpoints in: megatron-core 0.16.1 builds Llama-style MoE GPT
models on CPU gloo ranks (its local spec), saves them in `torch_dist` under expert and tensor
parallelism, and runs them again on one rank; tools/convert_checkpoint.py --from-megatron reads
them into our checkpoint, whose model gives megatron-core's logits within 1e-5: every layer an
MoE with gated shared experts (layer-stacked keys, the experts as an axis of them, saved under
TP 2 x EP 2 x ETP 2), dense layers among MoE ones (per-layer keys, EP 2), and a sigmoid router
with an expert bias. Their Adam state: tests/test_megatron_moe_optimizer.py."""

from __future__ import annotations

import argparse
import os
import warnings

import pytest
import torch

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.interop.megatron.layout import MegatronCheckpoint
from engine.model import BuildContext, GPTModel
from tests.distributed import rel_err, run_ranks
from tests.test_megatron_checkpoint import (
    CPU_CONFIG,
    SEQ,
    VOCAB,
    _args,
    _convert,
    megatron_forward,
)
from tests.test_megatron_export import _to_megatron
from tools.megatron_cpu import cuda_queries_on_cpu, router_without_transformer_engine

MOE = dict(num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2)
CASES = {
    "shared-gated": dict(MOE, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True),
    "dense-first": dict(MOE, moe_layer_freq=[0, 1, 1, 1]),
    "sigmoid-bias": dict(
        MOE,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.0,
    ),
}


def _megatron_moe(case: str, tp: int, ep: int, etp: int | None, pp: int = 1):
    warnings.simplefilter("ignore")
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda_queries_on_cpu()
    router_without_transformer_engine()
    parallel_state.initialize_model_parallel(
        tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    model_parallel_cuda_manual_seed(1234)
    options = dict(CASES[case])
    config = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=48,
        num_moe_experts=options.pop("num_experts"),
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        **CPU_CONFIG,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type="allgather",
        **options,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return MegatronGPT(
        config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        rotary_base=500,
        share_embeddings_and_output_weights=False,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def _moe_args(case: str) -> argparse.Namespace:
    args = _args("llama")
    for name, value in CASES[case].items():
        setattr(args, name, value)
    return args


def _save(rank, world, case, tp, ep, etp, path):
    from megatron.core import dist_checkpointing

    torch.manual_seed(100 + rank)
    model = _megatron_moe(case, tp, ep, etp)
    move_norms_and_expert_bias(model)
    state = model.sharded_state_dict(metadata={"singleton_local_shards": False})
    state |= {"args": _moe_args(case), "iteration": 7, "checkpoint_version": 3.0}
    state["opt_param_scheduler"] = {"num_steps": 56}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)


def move_norms_and_expert_bias(model) -> None:
    """Norm weights and the routers' expert bias away from their initial values (1 and 0),
    so that a reader who mixed them up would be caught."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.add_(torch.randn(buffer.shape, generator=torch.Generator()) * 0.1)


def _megatron_logits(rank, world, case, path, tokens):
    """megatron-core's logits at one rank from `path`; every key its model asks for must be
    there and nothing else (StrictHandling.RAISE_UNEXPECTED)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    model = _megatron_moe(case, 1, 1, None)
    state = model.sharded_state_dict(metadata={"singleton_local_shards": False})
    loaded = dist_checkpointing.load(state, path, strict=StrictHandling.RAISE_UNEXPECTED)
    missing, _ = model.load_state_dict(loaded, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    return megatron_forward(model, tokens)


@pytest.mark.parametrize(
    "case, tp, ep, etp",
    [("shared-gated", 2, 2, 2), ("dense-first", 1, 2, None), ("sigmoid-bias", 1, 2, None)],
)
def test_a_megatron_core_moe_checkpoint_converts_to_the_same_logits(case, tp, ep, etp, tmp_path):
    root = tmp_path / "megatron"
    folder = str(root / "iter_0000007")
    world = tp * ep if etp is None else max(tp, ep * etp)
    run_ranks(_save, world, case, tp, ep, etp, folder)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    [theirs] = run_ranks(_megatron_logits, 1, case, folder, tokens)
    stored = MegatronCheckpoint(folder).stored
    per_layer = "decoder.layers.0.mlp.linear_fc1.weight" in stored  # dense layers among MoE
    assert per_layer == (case == "dense-first")
    experts = (
        "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
        if per_layer
        else ("decoder.layers.mlp.experts.experts.linear_fc1.weight")
    )
    assert tuple(stored[experts].size)[-3] == 4  # the experts' axis
    ours_root = str(tmp_path / "ours")
    result = _convert(str(root), ours_root)
    assert result.returncode == 0, result.stderr
    path = iteration_dir(ours_root, find_latest(ours_root))
    cfg = ModelConfig(**read_meta(path)["model"])
    assert cfg.num_experts == 4 and cfg.moe_router_topk == 2
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    with torch.no_grad():
        ours = model.full_logits(model.eval()(tokens=tokens))
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB)
    assert rel_err(ours, theirs) < 1e-5
    # and back: megatron-core loads our export (stacked or per-layer keys alike) to its logits
    back = tmp_path / "back"
    result = _to_megatron(ours_root, str(back))
    assert result.returncode == 0, result.stderr
    [again] = run_ranks(_megatron_logits, 1, case, str(back / "iter_0000007"), tokens)
    assert rel_err(again, theirs) < 1e-5
