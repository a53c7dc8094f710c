"""RoPE settings between our flags and a Hugging Face config.json's `rope_parameters` (or the
older `rope_scaling` and `rope_theta` keys): default, llama3, linear, dynamic and YaRN."""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.config.rope_scaling import YarnScaling, rope_scaling_of
from engine.errors import ConfigError


def rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters for our RoPE settings."""
    return {"rope_theta": float(cfg.rotary_base), "rope_type": "default"} | (
        rope_scaling_of(cfg) or {}
    )


def rope_options(hf: dict) -> dict:
    """Our RoPE options for config.json's rope_parameters (or the older rope_scaling and
    rope_theta keys)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    out = {"rotary_base": int(theta)}
    if kind == "default":
        return out
    if kind == "llama3":
        return out | {
            "use_rope_scaling": True,
            "rope_scaling_factor": float(rope["factor"]),
            "rope_scaling_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
            "rope_scaling_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
            "rope_scaling_original_max_position_embeddings": int(
                rope.get("original_max_position_embeddings", 8192)
            ),
        }
    if kind == "linear":
        return out | {"rotary_seq_len_interpolation_factor": float(rope["factor"])}
    if kind == "dynamic":
        return out | {"rope_scaling_type": "dynamic", "rope_scaling_factor": float(rope["factor"])}
    if kind == "yarn":
        return out | _yarn_options(rope, hf)
    raise ConfigError(
        f"rope_type {kind!r} is not supported; default, llama3, linear, dynamic and yarn are"
    )


def _yarn_options(rope: dict, hf: dict) -> dict:
    """Our YaRN flags (Megatron-LM's) for a yarn rope_parameters; ConfigError for an
    attention_factor other than the one its mscales give (we have no flag for it)."""
    factor = rope.get("factor")
    original = rope["original_max_position_embeddings"]
    if factor is None:  # transformers then takes the ratio of the two lengths
        factor = hf["max_position_embeddings"] / original
    options = {
        "position_embedding_type": "yarn",
        "rotary_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": int(original),
        "yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(rope.get("beta_slow") or 1.0),
        "yarn_correction_range_round_to_int": bool(rope.get("truncate", True)),
    }
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # transformers reads the two only together
        options |= {"mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim)}
    implied = YarnScaling(
        options["rotary_scaling_factor"],
        mscale=options.get("mscale", 1.0),
        mscale_all_dim=options.get("mscale_all_dim", 0.0),
    ).attention_factor()
    given = rope.get("attention_factor")
    if given is not None and abs(float(given) - implied) > 1e-6 * implied:
        raise ConfigError(
            f"rope_parameters' attention_factor {given} differs from the {implied:.6g} its "
            "factor and mscales give; only the derived attention factor is available here"
        )
    return options
