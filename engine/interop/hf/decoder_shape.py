"""The options of a Llama-like decoder's shape read from a Hugging Face config.json, shared by
every family that has one (engine/interop/hf/architectures.py, gpt_oss.py)."""

from __future__ import annotations

from engine.interop.hf.rope import rope_options


def decoder_shape(hf: dict, norm_epsilon: float) -> dict:
    """Layers, widths, heads and key/value groups, lengths, vocabulary, RoPE and RMSNorm
    (`norm_epsilon`: the family's default where config.json has no rms_norm_eps)."""
    heads = hf["num_attention_heads"]
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        group_query_attention=True,
        num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        seq_length=hf.get("max_position_embeddings", 2048),
        max_position_embeddings=hf.get("max_position_embeddings"),
        vocab_size=hf["vocab_size"],
        **{"position_embedding_type": "rope"} | rope_options(hf),
        normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", norm_epsilon),
    )
