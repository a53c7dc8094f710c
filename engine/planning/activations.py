"""Activation memory of one transformer layer for one micro-batch, predicted tensor by tensor
from what the engine's layer saves for backward (engine/model/, the PyTorch op set of
engine/ops/torch_ops.py), with 16-bit activations and attention through torch's
scaled_dot_product_attention without attention dropout.

Terms, for T tokens per micro-batch (s x b), t the TP size, T_r = T / t between TP blocks
with sequence parallelism (T otherwise), a = 2 bytes per activation, d the head size, n and g
the query heads and key/value groups, f the MLP size:

- each norm: LayerNorm keeps its input and its mean and 1/std in the activation dtype,
  a T_r (h + 2); RMSNorm (computed in fp32) keeps the fp32 input and 1/rms and the 16-bit
  normalised input for the weight's gradient, (4 + a) T_r h + 4 T_r;
- the QKV and first MLP linears keep their input, a T_r h (under SP the shard, not the
  gathered tensor);
- the fused QKV output, whose views attention keeps, a T (n + 2g) d / t; RoPE makes new query
  and key tensors, a T (n + g) d / t, and keeps its cos and sin, 2 x 4 s d; query/key norms
  (RMSNorm per head) keep (4 + a) per element plus 4 per row of each;
- attention keeps its output, a T n d / t, and its fp32 log-sum-exp, 4 T n / t;
- each hidden dropout keeps its mask, `mask_bytes` T_r h (2 on CPU, where torch's dropout keeps
  it in the activation dtype; 1 on CUDA);
- the MLP: GELU keeps its input and output, 2 a T f / t; SwiGLU keeps the fused first
  projection, a T 2f / t, the SiLU of the gate and the product, 2 a T f / t.

The output projection's input is the attention output, already counted.

A run of layers (one model chunk, `layers_activation_bytes`) shares RoPE's tables, and
recomputation keeps less: full recomputation keeps each checkpointed group's input, a T_r h
(uniform: groups of N layers; block: the first N layers one by one, the rest whole);
selective recomputation reruns the core attention, whose log-sum-exp is then not kept.
With context parallelism (`cp`) a rank holds s / C of each sequence; the ring's received key
and value chunks are not counted. Not modelled yet: the fused CUDA kernels (which keep
less), and, refused in one line, attention dropout, partial RoPE (--rotary-percent below
1) and sliding-window attention. Activations are 16-bit.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.errors import ConfigError

ACTIVATION_BYTES = 2  # bf16 / fp16
ACTIVATION_DEVICE = "cpu"  # what the terms are measured on (CUDA's fused kernels keep less)


def norm_bytes(cfg: ModelConfig, rows: int, width: int) -> int:
    """What one norm over `rows` rows of `width` keeps (module docstring)."""
    a = ACTIVATION_BYTES
    if cfg.normalization == "LayerNorm":
        return a * rows * (width + 2)
    return (4 + a) * rows * width + 4 * rows


def _tokens(cfg: ModelConfig, tp: int, sequence_parallel: bool, micro_batch_size: int, cp: int):
    """(tokens of a micro-batch on a CP rank, the tokens a rank holds between TP blocks)."""
    tokens = cfg.seq_length // cp * micro_batch_size
    return tokens, tokens // tp if sequence_parallel and tp > 1 else tokens


def layer_activation_bytes(
    cfg: ModelConfig,
    tp: int = 1,
    sequence_parallel: bool = False,
    micro_batch_size: int = 1,
    mask_bytes: int = 2,
    cp: int = 1,
) -> int:
    """Bytes one layer, not recomputed, keeps for backward on one TP rank for one
    micro-batch of cfg.seq_length tokens per sample (module docstring)."""
    if cfg.attention_dropout:
        raise ConfigError(
            "the activation model assumes --attention-dropout 0 (as modern recipes run); pass "
            "--attention-dropout 0.0"
        )
    if cfg.selective_modules - {"core_attn", "mla_up_proj"}:
        raise ConfigError(
            "the activation model covers selective recomputation of core attention and MLA's "
            "up projections only (--recompute-modules core_attn mla_up_proj); drop the others"
        )
    if cfg.rotary_percent != 1.0 or cfg.window_size is not None:
        raise ConfigError(
            "the activation model does not cover --rotary-percent below 1 or --window-size yet"
        )
    a, s, h = ACTIVATION_BYTES, cfg.seq_length // cp, cfg.hidden_size
    n, g, d, f = cfg.num_attention_heads // tp, cfg.query_groups // tp, cfg.head_dim, cfg.ffn_size
    f //= tp
    tokens, between = _tokens(cfg, tp, sequence_parallel, micro_batch_size, cp)
    total = 2 * norm_bytes(cfg, between, h)  # input and pre-MLP norms
    total += 2 * a * between * h  # the inputs kept by the QKV and first MLP linears
    if cfg.multi_latent_attention:
        total += _latent_attention_bytes(cfg, tokens, between, n, s, cp)
        if cfg.hidden_dropout:
            total += 2 * mask_bytes * between * h
        return total + a * tokens * f * (4 if cfg.gated_linear_unit else 2)
    total += a * tokens * (n + 2 * g) * d  # the fused QKV output
    if cfg.qk_layernorm_across_heads:  # one row per token over this rank's heads
        total += norm_bytes(cfg, tokens, n * d) + norm_bytes(cfg, tokens, g * d)
    elif cfg.qk_layernorm:
        total += norm_bytes(cfg, tokens * n, d) + norm_bytes(cfg, tokens * g, d)
    if cfg.position_embedding_type == "rope":
        total += a * tokens * (n + g) * d + 2 * 4 * s * d
    total += a * tokens * n * d + 4 * tokens * n  # attention output, log-sum-exp
    if cfg.hidden_dropout:
        total += 2 * mask_bytes * between * h
    total += a * tokens * f * (4 if cfg.gated_linear_unit else 2)
    return total


def _latent_attention_bytes(cfg, tokens: int, between: int, n: int, s: int, cp: int) -> int:
    """What multi-latent attention keeps besides its input (module docstring): the latent
    norms and the latents the up projections keep (T_r rows), the queries, keys and values
    (one padded width on the CPU and under CP, engine/model/latent_attention.py), or with
    mla_up_proj only the shared RoPE key, and the attention output and log-sum-exp."""
    from engine.model.latent_attention import padded_width

    a, c, p = ACTIVATION_BYTES, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
    total = a * between * c + (norm_bytes(cfg, between, c) if cfg.qk_layernorm else 0)
    if cfg.q_lora_rank is not None:
        q = cfg.q_lora_rank
        total += a * between * q + (norm_bytes(cfg, between, q) if cfg.qk_layernorm else 0)
    width = padded_width(cfg, ACTIVATION_DEVICE, cp)
    query, value = (width, width) if width else (cfg.latent_query_head_dim, cfg.v_head_dim)
    if "mla_up_proj" in cfg.selective_modules:
        total += a * tokens * p  # the shared RoPE key, the up projections' one other input
    else:
        total += a * tokens * n * (2 * query + value)
    total += 2 * 4 * s * p  # RoPE's cos and sin (a chunk's, counted once there)
    total += a * tokens * n * value + 4 * tokens * n  # output, log-sum-exp
    if width:  # the output projection keeps its own copy of the output's unpadded part
        total += a * tokens * n * cfg.v_head_dim
    return total


def _recomputed_core_bytes(cfg: ModelConfig, tokens: int, n: int, cp: int) -> int:
    """What selective recomputation of core attention does not keep: its log-sum-exp and,
    where multi-latent attention's output is padded (its projection keeps a copy), the
    output itself."""
    from engine.model.latent_attention import padded_width

    width = padded_width(cfg, ACTIVATION_DEVICE, cp) if cfg.multi_latent_attention else None
    return 4 * tokens * n + (ACTIVATION_BYTES * tokens * n * width if width else 0)


def layers_activation_bytes(
    cfg: ModelConfig,
    num_layers: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    micro_batch_size: int = 1,
    mask_bytes: int = 2,
    cp: int = 1,
) -> int:
    """Bytes `num_layers` consecutive layers (one model chunk) keep for one micro-batch, with
    cfg's recomputation (module docstring)."""
    if num_layers == 0:
        return 0
    a, s, h = ACTIVATION_BYTES, cfg.seq_length // cp, cfg.hidden_size
    layer = layer_activation_bytes(cfg, tp, sequence_parallel, micro_batch_size, mask_bytes, cp)
    tables = 2 * 4 * s * cfg.rotary_dim if cfg.position_embedding_type == "rope" else 0
    layer -= tables  # counted once for the chunk, below
    tokens, between = _tokens(cfg, tp, sequence_parallel, micro_batch_size, cp)
    group_input = a * between * h
    if cfg.recompute_granularity == "full":
        n = cfg.recompute_num_layers
        if cfg.recompute_method == "uniform":
            return -(-num_layers // n) * group_input + tables
        recomputed = min(n, num_layers)  # block: the first N of the chunk
        return recomputed * group_input + (num_layers - recomputed) * layer + tables
    if "core_attn" in cfg.selective_modules:
        layer -= _recomputed_core_bytes(cfg, tokens, cfg.num_attention_heads // tp, cp)
    return num_layers * layer + tables


def stage_ends_activation_bytes(
    cfg: ModelConfig,
    padded_vocab: int,
    first: bool,
    last: bool,
    tp: int = 1,
    sequence_parallel: bool = False,
    micro_batch_size: int = 1,
    mask_bytes: int = 2,
    cp: int = 1,
) -> int:
    """Bytes the first stage's embedding and the last stage's head keep for one micro-batch
    (besides the layers): the token ids (8 T), learned positions (8 s) and the embedding
    dropout's mask; the final norm, the output layer's input (a T_r h) and what the
    vocab-parallel cross-entropy keeps: the logits in the activations' dtype (a T V / t), its
    fp32 row maximum and sum (8 T), target ids and padding mask (9 T)."""
    a, h = ACTIVATION_BYTES, cfg.hidden_size
    tokens, between = _tokens(cfg, tp, sequence_parallel, micro_batch_size, cp)
    total = 0
    if first:
        total += 8 * tokens
        if cfg.position_embedding_type == "learned_absolute":
            total += 8 * (cfg.seq_length // cp)
        if cfg.hidden_dropout:
            total += mask_bytes * between * h
    if last:
        total += norm_bytes(cfg, between, h) + a * between * h
        total += a * tokens * (padded_vocab // tp) + 17 * tokens
    return total
