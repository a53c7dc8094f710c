"""Megatron-LM `torch_dist` checkpoints of DeepSeek-V3-style models, in and out: megatron-core
0.16.1 builds a GPT model with multi-latent attention (its local spec; plain causal attention
in place of its PyTorch core attention, which takes no separate value width), a dense layer
then mixtures of experts behind the sigmoid router with an expert bias and a shared expert,
and one multi-token-prediction depth, on CPU gloo ranks under EP 2, and saves it;
tools/convert_checkpoint.py --from-megatron reads it into our checkpoint, whose model gives
megatron-core's losses and gradients (the MTP depth's included) within 1e-5; and
--to-megatron writes it back in a form megatron-core loads with every key it asks for, to the
same weights."""

from __future__ import annotations

import argparse
import os
import warnings

import torch

from engine.checkpoint.files import find_latest, iteration_dir, read_meta
from engine.checkpoint.load import load_model_weights
from engine.config.model import ModelConfig
from engine.data.multi_token import multi_token_targets
from engine.model import BuildContext, GPTModel
from engine.model.multi_token import TARGET_KEYS
from tests.distributed import rel_err, run_ranks
from tests.test_megatron_checkpoint import CPU_CONFIG, SEQ, VOCAB, _args, _convert
from tests.test_megatron_export import _to_megatron
from tests.test_megatron_moe_checkpoint import move_norms_and_expert_bias
from tools.megatron_cpu import cuda_queries_on_cpu, router_without_transformer_engine

SHAPE = dict(
    num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, q_lora_rank=12,
    kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, mtp_num_layers=1,
    moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, moe_router_topk=2,
)  # fmt: skip
GRADS = (  # megatron-core's name: ours
    ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.eh_proj.weight"),
    ("mtp.layers.0.enorm.weight", "mtp.layers.0.enorm.weight"),
    ("mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight",
     "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"),
    ("decoder.layers.1.self_attention.linear_q_down_proj.weight",
     "layers.1.self_attention.linear_q_down_proj.weight"),
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
)  # fmt: skip


def _megatron_model(ep: int):
    warnings.simplefilter("ignore")
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from tests.test_latent_attention import _ReferenceCoreAttention

    cuda_queries_on_cpu()
    router_without_transformer_engine()
    mla_module.HAVE_TE = False  # (see tests/test_latent_attention.py)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    s = SHAPE
    config = MLATransformerConfig(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"], ffn_hidden_size=s["ffn_hidden_size"],
        q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"],
        qk_head_dim=s["qk_head_dim"], qk_pos_emb_head_dim=s["qk_pos_emb_head_dim"],
        v_head_dim=s["v_head_dim"], rope_type="yarn", rotary_scaling_factor=4.0,
        mscale=1.0, mscale_all_dim=1.0, rotary_base=500, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=True, mtp_num_layers=1, num_moe_experts=4, moe_layer_freq=[0, 1, 1],
        moe_ffn_hidden_size=s["moe_ffn_hidden_size"],
        moe_shared_expert_intermediate_size=s["moe_shared_expert_intermediate_size"],
        moe_router_topk=2, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=ep, **CPU_CONFIG,
    )  # fmt: skip
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _ReferenceCoreAttention
    return MegatronGPT(
        config, spec, VOCAB, SEQ, position_embedding_type="rope", rotary_base=500,
        share_embeddings_and_output_weights=False,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )  # fmt: skip


def _latent_args() -> argparse.Namespace:
    args = _args("llama")
    args.group_query_attention, args.num_query_groups = False, None
    for name, value in SHAPE.items():
        setattr(args, name, value)
    extra = dict(
        multi_latent_attention=True, rope_type=None, rotary_scaling_factor=4.0, mscale=1.0,
        mscale_all_dim=1.0, qk_layernorm=True, num_experts=4, moe_layer_freq=[0, 1, 1],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        mtp_loss_scaling_factor=0.1,
    )  # fmt: skip
    for name, value in extra.items():
        setattr(args, name, value)
    return args


def _save(rank, world, path):
    from megatron.core import dist_checkpointing

    torch.manual_seed(100 + rank)
    model = _megatron_model(world)
    move_norms_and_expert_bias(model)
    state = model.sharded_state_dict(metadata={"singleton_local_shards": False})
    state |= {"args": _latent_args(), "iteration": 7, "checkpoint_version": 3.0}
    state["opt_param_scheduler"] = {"num_steps": 56}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(state, path)


def _megatron_run(rank, world, path, tokens):
    """megatron-core's model at one rank from `path` (every key it asks for must be there):
    its token losses (MTP attached: with it, megatron-core's model runs only with labels) and
    the gradients of their mean."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    model = _megatron_model(1)
    state = model.sharded_state_dict(metadata={"singleton_local_shards": False})
    loaded = dist_checkpointing.load(state, path, strict=StrictHandling.RAISE_UNEXPECTED)
    missing, _ = model.load_state_dict(loaded, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    positions = torch.arange(SEQ)[None].expand(tokens.shape[0], SEQ)
    loss = model.train()(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])
    loss.mean().backward()
    params = dict(model.named_parameters())
    return loss.detach(), {theirs: params[theirs].grad for theirs, _ in GRADS}


def test_a_megatron_core_deepseek_checkpoint_comes_in_and_goes_out(tmp_path):
    root = tmp_path / "megatron"
    folder = str(root / "iter_0000007")
    run_ranks(_save, 2, folder)
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    [(loss, grads)] = run_ranks(_megatron_run, 1, folder, tokens)
    ours_root = str(tmp_path / "ours")
    result = _convert(str(root), ours_root)
    assert result.returncode == 0, result.stderr
    path = iteration_dir(ours_root, find_latest(ours_root))
    cfg = ModelConfig(**read_meta(path)["model"])
    assert cfg.multi_latent_attention and cfg.mtp_num_layers == 1 and cfg.num_experts == 4
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(path, model)
    batch = multi_token_targets({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, 1)
    targets = {key: batch[key] for key in TARGET_KEYS}
    out, _, _ = model.train()(batch["tokens"], batch["labels"], mtp_targets=targets)
    assert rel_err(out, loss) < 1e-5
    out.mean().backward()
    mine = dict(model.named_parameters())
    for theirs, name in GRADS:
        assert rel_err(mine[name].grad, grads[theirs]) < 1e-5, name
    # and back: megatron-core loads our export to the same losses and gradients
    back = tmp_path / "back"
    result = _to_megatron(ours_root, str(back))
    assert result.returncode == 0, result.stderr
    [(again_loss, again_grads)] = run_ranks(_megatron_run, 1, str(back / "iter_0000007"), tokens)
    assert torch.equal(again_loss, loss)
    for theirs, _ in GRADS:
        assert torch.equal(again_grads[theirs], grads[theirs]), theirs


def test_layernorm_mla_and_mtp_come_back_from_megatrons_layout(tmp_path):
    """With LayerNorm (weights and biases) on the inputs, the latents and the MTP depth, a
    checkpoint written in Megatron-LM's layout reads back bit for bit."""
    from tests.test_training import pretrain

    argv = [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
        "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "10",
        "--qk-head-dim", "6", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "5",
        "--qk-layernorm", "--position-embedding-type", "rope", "--mtp-num-layers", "1",
        "--save", str(tmp_path / "ours"),
    ]  # fmt: skip
    assert pretrain(1, argv) == [0]
    assert _to_megatron(str(tmp_path / "ours"), str(tmp_path / "megatron")).returncode == 0
    result = _convert(str(tmp_path / "megatron"), str(tmp_path / "back"))
    assert result.returncode == 0, result.stderr
    models = []
    for name in ("ours", "back"):
        path = iteration_dir(str(tmp_path / name), find_latest(str(tmp_path / name)))
        cfg = ModelConfig(**read_meta(path)["model"])
        models.append(GPTModel(cfg, BuildContext(cfg)))
        load_model_weights(path, models[-1])
    assert cfg.normalization == "LayerNorm" and cfg.mtp_num_layers == 1
    back = dict(models[1].named_parameters())
    biases = {n for n in back if n.endswith("norm.bias")}
    assert {"mtp.layers.0.enorm.bias", "layers.0.self_attention.kv_layernorm.bias"} <= biases
    for name, param in models[0].named_parameters():
        assert torch.equal(param, back[name]), name
