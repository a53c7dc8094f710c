"""Megatron-LM `torch_dist` checkpoints of gpt-oss-style models, in and out: megatron-core
0.16.1 builds a GPT model whose every layer is a mixture of experts with biases (router and
experts) and gpt-oss's clamped quick-GELU gated unit (--quick-geglu --glu-linear-offset 1
--activation-func-clamp-value 7), attention with biases, learned sinks (--softmax-type
learnable) and a sliding window on every other layer (--window-attn-skip-freq 2), on CPU gloo
ranks under EP 2, and saves it; tools/convert_checkpoint.py --from-megatron reads it into our
checkpoint, whose model gives megatron-core's logits within 1e-5, and --to-megatron writes it
back in a form megatron-core loads (every key it asks for) to the same logits."""

from __future__ import annotations

import os
import warnings

import torch

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.model import BuildContext, GPTModel
from tests.distributed import rel_err, run_ranks
from tests.test_megatron_checkpoint import CPU_CONFIG, SEQ, VOCAB, _args, _convert
from tests.test_megatron_export import _to_megatron
from tools.megatron_cpu import (
    cuda_queries_on_cpu,
    cuda_tensors_on_cpu,
    router_without_transformer_engine,
)

GPT_OSS = dict(
    num_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2, add_bias_linear=True,
    quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
    softmax_type="learnable", window_size=(5, 0), window_attn_skip_freq=2,
)  # fmt: skip


def _megatron_model(ep: int):
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.activations import quick_gelu
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda_queries_on_cpu()
    cuda_tensors_on_cpu()  # (its sliding-window mask is made on "cuda")
    router_without_transformer_engine()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1234)
    options = {k: v for k, v in GPT_OSS.items() if k not in ("num_experts", "quick_geglu")}
    config = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, num_moe_experts=4, gated_linear_unit=True, activation_func=quick_gelu,
        normalization="RMSNorm", **CPU_CONFIG, expert_model_parallel_size=ep,
        moe_token_dispatcher_type="allgather", **options,
    )  # fmt: skip
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return MegatronGPT(
        config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope", rotary_base=500,
        share_embeddings_and_output_weights=False,
    )  # fmt: skip


def _save(rank, world, path):
    from megatron.core import dist_checkpointing

    torch.manual_seed(100 + rank)
    model = _megatron_model(world)
    with torch.no_grad():  # biases start at 0 and norms at 1: move them, so they count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "softmax_offset" in name:
                param.add_(torch.randn_like(param) * 0.3)
    state = model.sharded_state_dict(metadata={"singleton_local_shards": False})
    args = _args("llama")
    args.swiglu = False  # (the gated unit is --quick-geglu's)
    for name, value in GPT_OSS.items():
        setattr(args, name, value)
    state |= {"args": args, "iteration": 7, "checkpoint_version": 3.0}
    state["opt_param_scheduler"] = {"num_steps": 56}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)


def _megatron_logits(rank, world, path, tokens):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from tests.test_megatron_checkpoint import megatron_forward

    model = _megatron_model(1)
    state = model.sharded_state_dict(metadata={"singleton_local_shards": False})
    loaded = dist_checkpointing.load(state, path, strict=StrictHandling.RAISE_UNEXPECTED)
    missing, _ = model.load_state_dict(loaded, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    return megatron_forward(model, tokens)


def test_a_megatron_core_gpt_oss_checkpoint_comes_in_and_goes_out(tmp_path):
    root = tmp_path / "megatron"
    folder = str(root / "iter_0000007")
    run_ranks(_save, 2, folder)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    [theirs] = run_ranks(_megatron_logits, 1, folder, tokens)
    ours_root = str(tmp_path / "ours")
    result = _convert(str(root), ours_root)
    assert result.returncode == 0, result.stderr
    path = iteration_dir(ours_root, find_latest(ours_root))
    cfg = ModelConfig(**read_meta(path)["model"])
    assert cfg.softmax_type == "learnable" and cfg.quick_geglu
    assert cfg.window_of(0) == 5 and cfg.window_of(1) is None
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    with torch.no_grad():
        ours = model.full_logits(model.eval()(tokens=tokens))
    assert rel_err(ours, theirs) < 1e-5
    back = tmp_path / "back"
    result = _to_megatron(ours_root, str(back))
    assert result.returncode == 0, result.stderr
    [again] = run_ranks(_megatron_logits, 1, str(back / "iter_0000007"), tokens)
    assert rel_err(again, theirs) < 1e-6
