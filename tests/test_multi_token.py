"""Multi-token prediction (--mtp-num-layers, --mtp-loss-scaling-factor): a model with two
depths against megatron-core 0.16.1's GPTModel with its MultiTokenPredictionBlock on the same
weights (fp64; multi-latent attention, SwiGLU; the loss and every weight's gradient, the MTP
losses' included), the depths' targets (engine/data/multi_token.py), parity with one process
under TP2 x SP, CP2, PP2 and DP2 (with and without --calculate-per-token-loss), the `mtp_1
loss` beside `lm loss`, and the flags it refuses."""

from __future__ import annotations

import pytest
import torch

from engine.config.model import ModelConfig
from engine.data.multi_token import multi_token_targets
from engine.errors import ConfigError
from engine.model import BuildContext, GPTModel
from engine.model.multi_token import TARGET_KEYS
from tests.distributed import rel_err, run_ranks
from tests.requirements import require

SEQ, B, HIDDEN, HEADS, VOCAB = 12, 2, 24, 4, 64
MODEL = dict(
    num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
    max_position_embeddings=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=1,
    ffn_hidden_size=40, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
    add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
    attention_dropout=0.0, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10,
    qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True,
    mtp_num_layers=2, mtp_loss_scaling_factor=0.3, init_method_std=0.2,
)  # fmt: skip


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def test_targets_look_k_places_ahead_and_mask_the_end():
    tokens = torch.arange(10).reshape(1, 10)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    out = multi_token_targets(batch, 2)
    assert out["mtp_tokens"][0, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert out["mtp_labels"][0, :, 1].tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 0]
    assert out["mtp_mask"][0, :, 1].tolist() == [1] * 7 + [0, 0]
    assert out["mtp_counts"].tolist() == [8, 7]


def _megatron(rank, world, weights, tokens):
    """megatron-core's GPTModel with MLA layers and a 2-depth MTP block (local specs; plain
    causal attention in place of its PyTorch core attention, which takes no separate value
    width) on our weights: loss [b, s] and every gradient of loss.mean()."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from tests.test_latent_attention import _ReferenceCoreAttention
    from tools.megatron_cpu import CPU_CONFIG, cuda_queries_on_cpu, cuda_tensors_on_cpu

    cuda_queries_on_cpu()
    cuda_tensors_on_cpu()
    mla_module.HAVE_TE = False  # (see tests/test_latent_attention.py)
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    m = MODEL
    config = MLATransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=m["ffn_hidden_size"], q_lora_rank=m["q_lora_rank"],
        kv_lora_rank=m["kv_lora_rank"], qk_head_dim=m["qk_head_dim"],
        qk_pos_emb_head_dim=m["qk_pos_emb_head_dim"], v_head_dim=m["v_head_dim"],
        rope_type="yarn", rotary_scaling_factor=1.0, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=True, params_dtype=torch.float64, mtp_num_layers=2,
        mtp_loss_scaling_factor=m["mtp_loss_scaling_factor"], **CPU_CONFIG,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = _ReferenceCoreAttention
    model = MegatronGPT(
        config, spec, VOCAB, SEQ, position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    ).double()  # fmt: skip
    params = dict(model.named_parameters())
    theirs = {_megatron_name(name): name for name in weights}
    assert sorted(theirs) == sorted(params), sorted(set(params) ^ set(theirs))
    with torch.no_grad():
        for mine, value in weights.items():
            params[_megatron_name(mine)].copy_(value)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    positions = torch.arange(SEQ)[None].expand(B, SEQ)
    loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])
    loss.mean().backward()
    return loss.detach(), {mine: params[_megatron_name(mine)].grad for mine in weights}


def _megatron_name(ours: str) -> str:
    if ours.startswith("layers."):
        return "decoder." + ours
    return "decoder.final_layernorm.weight" if ours == "final_layernorm.weight" else ours


def _ours(cfg: ModelConfig, tokens: torch.Tensor):
    model = GPTModel(cfg, BuildContext(cfg, params_dtype=torch.float64))
    batch = multi_token_targets({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, 2)
    targets = {key: batch[key] for key in TARGET_KEYS}
    loss, _, depths = model(batch["tokens"], batch["labels"], mtp_targets=targets)
    return model, loss, depths


def test_multi_token_prediction_equals_megatron_cores():
    require("megatron.core")
    tokens = _tokens()
    model, loss, depths = _ours(ModelConfig(**MODEL), tokens)
    loss.mean().backward()
    weights = {name: p.detach() for name, p in model.named_parameters()}
    ((their_loss, their_grads),) = run_ranks(_megatron, 1, weights, tokens)
    assert rel_err(loss, their_loss) < 1e-6  # (the main loss: MTP adds only to the gradient)
    for name, param in model.named_parameters():
        assert rel_err(param.grad, their_grads[name]) < 1e-6, name
    assert any(name.startswith("mtp.layers.1.") for name in weights)
    # the depths' losses took part: without them the gradients differ
    plain, plain_loss, _ = _ours(ModelConfig(**MODEL | {"mtp_loss_scaling_factor": 0.0}), tokens)
    plain_loss.mean().backward()
    grad = dict(plain.named_parameters())["layers.0.mlp.linear_fc2.weight"].grad
    assert rel_err(grad, their_grads["layers.0.mlp.linear_fc2.weight"]) > 1e-3
    assert depths.shape == (2,) and (depths > 0).all()


def test_refused_flags():
    with pytest.raises(ConfigError, match="--mtp-num-layers 0"):
        ModelConfig(**MODEL | {"mtp_num_layers": 0}).validate()
    with pytest.raises(ConfigError, match="needs rotary positions"):
        learned = {"position_embedding_type": "learned_absolute", "multi_latent_attention": False}
        ModelConfig(**MODEL | learned).validate()


LAYOUTS = {
    "tp2-sp": dict(tp=2),
    "cp2": dict(cp=2),
    "pp2": dict(pp=2),
    "pp2-tied": dict(pp=2, tied=True),
    "dp2": dict(),
    "dp2-per-token": dict(per_token=True),
}
REFERENCES = {"one": {}, "tied-one": dict(tied=True)}


def _layout_config(tied: bool = False):
    from tests.harness import tiny_config

    return tiny_config(
        "llama", mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
        untie_embeddings_and_output_weights=not tied,
    )  # fmt: skip


def _grads(rank, world, name):
    from parallel.state import ParallelState
    from tests.harness import engine_grads, global_batch

    layout = (LAYOUTS | REFERENCES).get(name, {})
    state = ParallelState.build(
        tp=layout.get("tp", 1), pp=layout.get("pp", 1), cp=layout.get("cp", 1)
    )
    cfg = _layout_config(layout.get("tied", False))
    tokens = global_batch(4, 4, cfg.seq_length)
    _, grads = engine_grads(
        state, cfg, tokens, 2 // state.dp_size, sequence_parallel=layout.get("tp", 1) > 1,
        per_token_loss=layout.get("per_token", False),
    )  # fmt: skip
    return grads


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_multi_token_prediction_matches_one_process(name):
    """Every gradient (the embedding's copy on the last stage included) equals one
    process's, which includes the depths' losses."""
    from tests.harness import compare_params

    layout = LAYOUTS[name]
    (reference,) = run_ranks(_grads, 1, "one" if not layout.get("per_token") else name)
    if layout.get("tied"):
        (reference,) = run_ranks(_grads, 1, "tied-one")
    found = set()
    for grads in run_ranks(_grads, 2, name):
        assert max(compare_params(grads, reference).values()) < 1e-5, name
        found |= {n for n in grads if n.startswith("mtp.layers.1.")}
    assert found


def test_mtp_loss_is_logged_beside_lm_loss(dataset_prefix, tokenizer_model, tmp_path):
    """`mtp_1 loss` and `mtp_2 loss` in the log (JSONL mtp_<k>_loss; TensorBoard's
    Megatron-LM tag `mtp_<k> loss`), the same in one process and under TP2 x SP x PP2."""
    import math

    from engine.monitor.metrics import tensorboard_scalars
    from tests.test_training import base_args, pretrain, records

    found = {}
    for world, layout in ((1, {}), (4, {"--tensor-model-parallel-size": "2",
                                          "--pipeline-model-parallel-size": "2",
                                          "--sequence-parallel": True})):  # fmt: skip
        log = str(tmp_path / f"log{world}.jsonl")
        args = base_args(
            dataset_prefix, tokenizer_model, **layout,
            **{"--train-iters": "3", "--log-jsonl": log, "--hidden-dropout": "0",
               "--attention-dropout": "0", "--mtp-num-layers": "2",
               "--position-embedding-type": "rope", "--normalization": "RMSNorm",
               "--swiglu": True, "--untie-embeddings-and-output-weights": True},
        )  # fmt: skip
        assert pretrain(world, args) == [0] * world
        found[world] = [r for r in records(log) if "mtp_1_loss" in r]
    assert len(found[1]) == len(found[4]) == 3
    for one, four in zip(found[1], found[4], strict=True):
        for key in ("lm_loss", "mtp_1_loss", "mtp_2_loss"):
            assert math.isclose(one[key], four[key], rel_tol=1e-5), key
    tags = {tag for tag, _, _ in tensorboard_scalars(found[1][0])}
    assert {"mtp_1 loss", "mtp_2 loss", "lm loss"} <= tags


def _last_stage_bytes(depths):
    from engine.data.multi_token import multi_token_targets
    from engine.planning.saved_activations import saved_activation_bytes
    from tests.harness import tiny_config

    cfg = tiny_config(
        "llama", num_layers=2, hidden_size=64, seq_length=32, hidden_dropout=0.1,
        mtp_num_layers=depths,
    )  # fmt: skip
    model = GPTModel(cfg, BuildContext(cfg, params_dtype=torch.bfloat16), pre_process=False)
    tokens = _tokens().repeat(1, 3)[:, : cfg.seq_length + 1] % cfg.vocab_size
    batch = multi_token_targets({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, depths or 1)
    x = torch.randn(cfg.seq_length, B, 64).to(torch.bfloat16).requires_grad_()
    extra = {"mtp_targets": {k: batch[k] for k in TARGET_KEYS}} if depths else {}
    run = lambda: model.train()(hidden=x, labels=batch["labels"], **extra)  # noqa: E731
    return cfg, saved_activation_bytes(run, model.parameters())[1]


def test_the_planner_counts_each_depths_activations():
    """A last stage with two depths keeps what it keeps without them plus twice the
    planner's count of a depth (measured: to the byte but for 8)."""
    from engine.planning.memory import Layout, _mtp_depth_bytes

    _, without = _last_stage_bytes(None)
    cfg, with_two = _last_stage_bytes(2)
    shape = (1, False, B, 2, 1)
    depth = _mtp_depth_bytes(cfg, Layout(), shape, cfg.padded_vocab_size(1))
    assert abs((with_two - without) - 2 * depth) <= 16, (with_two - without, 2 * depth)
