"""The FLOP count behind tokens/s, TFLOP/s and MFU (engine/monitor/metrics.py:
model_flops_per_token) against torch.utils.flop_counter.FlopCounterMode on a real forward and
backward of the engine's model: GPT-2 style, Llama style with grouped-query attention, a
mixture of experts with gated shared experts and a dense layer (the routed experts counted
top-k times, the router too), and multi-latent attention (its five projections). On the CPU
the counter sees the GEMMs but not the attention kernel, so the count's core-attention term,
3 x 2 x layers x seq x heads x (query/key + value width per head) per token (Megatron-LM's,
causal masking not halved), is set beside it apart: everything else is equal, exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.model import BuildContext, GPTModel
from engine.monitor.metrics import model_flops_per_token
from tests.harness import VOCAB, tiny_config

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
    moe_shared_expert_intermediate_size=32,
    moe_shared_expert_gate=True,
    moe_layer_freq="[0,1]",
)


MLA = dict(
    group_query_attention=False,
    num_query_groups=None,
    multi_latent_attention=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_head_dim=12,
    qk_pos_emb_head_dim=4,
    v_head_dim=10,
    qk_layernorm=True,
)


MTP = MOE | dict(moe_layer_freq="[0,1]", mtp_num_layers=2)


@pytest.mark.parametrize(
    "style, options",
    [("gpt2", {}), ("llama", {}), ("llama", MOE), ("llama", MLA), ("llama", MTP)],
    ids=["gpt2", "llama-gqa", "moe", "multi-latent", "multi-token"],
)
def test_the_flop_count_equals_torchs_counter_on_a_real_step(style, options):
    cfg = tiny_config(style, **SHAPE, **options)
    model = GPTModel(cfg, BuildContext(cfg, seed=1))
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(2))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    extra = {}
    if cfg.mtp_depths:  # (each depth's layer, projection and head)
        from engine.data.multi_token import multi_token_targets
        from engine.model.multi_token import TARGET_KEYS

        batch = multi_token_targets(batch, cfg.mtp_depths)
        extra = {"mtp_targets": {key: batch[key] for key in TARGET_KEYS}}
    with FlopCounterMode(display=False) as counter:
        output = model(batch["tokens"], batch["labels"], **extra)
        (output[0] if isinstance(output, tuple) else output).mean().backward()
    counted = counter.get_total_flops()
    n = tokens[:, 1:].numel()
    widths = 2 * cfg.head_dim  # (query/key and value widths per head)
    if cfg.multi_latent_attention:
        widths = cfg.latent_query_head_dim + cfg.v_head_dim
    layers = cfg.num_layers + cfg.mtp_depths
    attention = 3 * 2 * layers * cfg.seq_length * cfg.num_attention_heads * widths
    ours = model_flops_per_token(cfg, cfg.padded_vocab_size(1))
    assert counted > 0 and (ours - attention) * n == counted
