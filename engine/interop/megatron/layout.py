"""megatron-core's GPT layout: the model its saved arguments describe, the names and fused
layout of its tensors, and reading them from a `torch_dist` checkpoint (nothing unpickled but
DCP's own metadata classes).

The layer tensors carry the layer as their first dimension. megatron-core fuses, per query
group, the group's query heads, then its key head, then its value head into `linear_qkv`, and
SwiGLU's gate and up projections (all of the gate, then all of up) into `linear_fc1`;
`split_part` takes them apart into our q, k, v and gate, up and `join_parts` puts them back.
"""

from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.errors import InputError
from engine.interop.megatron.latent_layout import (
    latent_attention_sources,
    latent_options_from_args,
    mtp_depth_keys,
    mtp_layer_key,
)
from engine.interop.megatron.moe_layout import moe_layer_sources, moe_options_from_args
from parallel.checkpoint.dcp import SafeFileSystemReader
from parallel.errors import CheckpointError


def model_config_from_args(args) -> ModelConfig:
    """Our ModelConfig from Megatron-LM's saved arguments (the padded vocabulary is the
    vocabulary: Megatron-LM's softmax runs over every padded row too)."""
    get = vars(args).get
    swiglu = bool(get("swiglu"))
    position = get("position_embedding_type") or "learned_absolute"
    normalization = get("normalization") or "LayerNorm"
    if position not in ("learned_absolute", "rope", "yarn") or normalization not in (
        "LayerNorm",
        "RMSNorm",
    ):
        raise InputError(
            f"the checkpoint's model uses --position-embedding-type {position} and "
            f"--normalization {normalization}; only learned_absolute/rope/yarn and "
            "LayerNorm/RMSNorm are available here"
        )
    unsupported = {
        "apply_residual_connection_post_layernorm": get("apply_residual_connection_post_layernorm"),
    }
    for name, used in unsupported.items():
        if used:
            raise InputError(
                f"the checkpoint's model uses --{name.replace('_', '-')}, which this engine's "
                "model does not have yet; it cannot be loaded as the same model"
            )
    return ModelConfig(
        num_layers=get("num_layers"),
        hidden_size=get("hidden_size"),
        num_attention_heads=get("num_attention_heads"),
        group_query_attention=bool(get("group_query_attention")),
        num_query_groups=get("num_query_groups") if get("group_query_attention") else None,
        ffn_hidden_size=get("ffn_hidden_size"),
        kv_channels=get("kv_channels"),
        seq_length=get("seq_length"),
        max_position_embeddings=get("max_position_embeddings"),
        vocab_size=get("padded_vocab_size"),
        make_vocab_size_divisible_by=1,
        position_embedding_type=position,
        rotary_base=int(get("rotary_base") or 10000),
        rotary_percent=float(get("rotary_percent") or 1.0),
        # Megatron-LM's Llama 3.x scaling keeps low/high frequency factors 1 and 4 and an
        # original length of 8192: this engine's defaults
        use_rope_scaling=bool(get("use_rope_scaling")),
        rope_scaling_factor=float(get("rope_scaling_factor") or 8.0),
        rotary_seq_len_interpolation_factor=get("rotary_seq_len_interpolation_factor"),
        **_yarn_options(get) if position == "yarn" else {},
        normalization=normalization,
        norm_epsilon=float(get("norm_epsilon") or 1e-5),
        apply_layernorm_1p=bool(get("apply_layernorm_1p")),
        swiglu=swiglu,
        openai_gelu=bool(get("openai_gelu")),
        bias_gelu_fusion=bool(get("bias_gelu_fusion", True)),
        squared_relu=bool(get("squared_relu")),
        rotary_interleaved=bool(get("rotary_interleaved")),
        add_bias_linear=bool(get("add_bias_linear", True)),
        add_qkv_bias=bool(get("add_qkv_bias")) and not get("multi_latent_attention"),
        window_size=str(tuple(get("window_size"))) if get("window_size") else None,
        **_gpt_oss_options(get),
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights")),
        qk_layernorm=bool(get("qk_layernorm")),
        hidden_dropout=float(get("hidden_dropout") or 0.0),
        attention_dropout=float(get("attention_dropout") or 0.0),
        init_method_std=float(get("init_method_std") or 0.02),
        **moe_options_from_args(get),
        **latent_options_from_args(get),
    )


def _gpt_oss_options(get) -> dict:
    """gpt-oss's attention and MLP fields from Megatron-LM's saved arguments (the same names;
    --window-attn-skip-freq, an integer or a 0/1 list there, our string form)."""
    skip = get("window_attn_skip_freq")
    offset, clamp = get("glu_linear_offset"), get("activation_func_clamp_value")
    return {
        "window_attn_skip_freq": None if skip is None else str(skip),
        "softmax_type": get("softmax_type") or "vanilla",
        "quick_geglu": bool(get("quick_geglu")),
        "glu_linear_offset": float(offset or 0.0),
        "activation_func_clamp_value": None if clamp is None else float(clamp),
    }


def _yarn_options(get) -> dict:
    """Our YaRN fields from Megatron-LM's arguments (its defaults where they are unset)."""
    round_to_int = get("yarn_correction_range_round_to_int")
    return {
        "rotary_scaling_factor": float(get("rotary_scaling_factor") or 1.0),
        "yarn_original_max_position_embeddings": get("yarn_original_max_position_embeddings"),
        "yarn_beta_fast": get("yarn_beta_fast"),
        "yarn_beta_slow": get("yarn_beta_slow"),
        "mscale": float(get("mscale") if get("mscale") is not None else 1.0),
        "mscale_all_dim": float(get("mscale_all_dim") or 0.0),
        "yarn_correction_range_round_to_int": True if round_to_int is None else round_to_int,
    }


def layer_sources(cfg: ModelConfig, moe: bool = False) -> dict[str, list[tuple]]:
    """Our tensor (within one layer, an MoE one with `moe`) -> [(megatron-core's
    layer-stacked key, part, expert or None)], first present wins."""
    sources = {
        ours: [(key, part, None) for key, part in found]
        for ours, found in _layer_sources(cfg).items()
    }
    if not moe:
        return sources
    dense_mlp = [ours for ours in sources if ours.startswith("mlp.")]
    for ours in dense_mlp:
        del sources[ours]
    return sources | moe_layer_sources(cfg)


def as_index(index: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """A leading-axes index: () for none, (layer,) for an int."""
    if index is None:
        return ()
    return (index,) if isinstance(index, int) else tuple(index)


def _layer_sources(cfg: ModelConfig) -> dict[str, list[tuple[str, str]]]:
    """Our tensor (within layer i) -> [(megatron-core key, part)], first match wins: the norm
    weights have two names (fused into the next linear, as TransformerEngine and the saved
    layout of the local layers name them, or their own)."""
    attn, mlp = "decoder.layers.self_attention", "decoder.layers.mlp"
    out = {
        "input_layernorm.weight": [
            (f"{attn}.linear_qkv.layer_norm_weight", ""),
            ("decoder.layers.input_layernorm.weight", ""),
        ],
        "pre_mlp_layernorm.weight": [
            (f"{mlp}.linear_fc1.layer_norm_weight", ""),
            ("decoder.layers.pre_mlp_layernorm.weight", ""),
        ],
        "self_attention.linear_qkv.weight.q": [(f"{attn}.linear_qkv.weight", "q")],
        "self_attention.linear_qkv.weight.k": [(f"{attn}.linear_qkv.weight", "k")],
        "self_attention.linear_qkv.weight.v": [(f"{attn}.linear_qkv.weight", "v")],
        "self_attention.linear_proj.weight": [(f"{attn}.linear_proj.weight", "")],
        "mlp.linear_fc2.weight": [(f"{mlp}.linear_fc2.weight", "")],
    }
    if cfg.gated_linear_unit:
        out["mlp.linear_fc1.weight.gate"] = [(f"{mlp}.linear_fc1.weight", "gate")]
        out["mlp.linear_fc1.weight.up"] = [(f"{mlp}.linear_fc1.weight", "up")]
    else:
        out["mlp.linear_fc1.weight"] = [(f"{mlp}.linear_fc1.weight", "")]
    if cfg.normalization == "LayerNorm":
        out["input_layernorm.bias"] = [
            (f"{attn}.linear_qkv.layer_norm_bias", ""),
            ("decoder.layers.input_layernorm.bias", ""),
        ]
        out["pre_mlp_layernorm.bias"] = [
            (f"{mlp}.linear_fc1.layer_norm_bias", ""),
            ("decoder.layers.pre_mlp_layernorm.bias", ""),
        ]
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        for part in ("q", "k", "v"):
            out[f"self_attention.linear_qkv.bias.{part}"] = [(f"{attn}.linear_qkv.bias", part)]
    if cfg.add_bias_linear:
        out["self_attention.linear_proj.bias"] = [(f"{attn}.linear_proj.bias", "")]
        out["mlp.linear_fc2.bias"] = [(f"{mlp}.linear_fc2.bias", "")]
        if cfg.gated_linear_unit:
            out["mlp.linear_fc1.bias.gate"] = [(f"{mlp}.linear_fc1.bias", "gate")]
            out["mlp.linear_fc1.bias.up"] = [(f"{mlp}.linear_fc1.bias", "up")]
        else:
            out["mlp.linear_fc1.bias"] = [(f"{mlp}.linear_fc1.bias", "")]
    if cfg.qk_layernorm:
        for norm in ("q_layernorm", "k_layernorm"):
            out[f"self_attention.{norm}.weight"] = [(f"{attn}.{norm}.weight", "")]
            if cfg.normalization == "LayerNorm":
                out[f"self_attention.{norm}.bias"] = [(f"{attn}.{norm}.bias", "")]
    if cfg.softmax_type == "learnable":  # gpt-oss's sinks, a logit per head
        key = f"{attn}.core_attention.softmax_offset"
        out["self_attention.core_attention.softmax_offset"] = [(key, "")]
    if cfg.multi_latent_attention:  # its own attention tensors (latent_layout.py)
        attention = ("self_attention.", "input_layernorm.")
        out = {k: v for k, v in out.items() if not k.startswith(attention)}
        out |= latent_attention_sources(cfg)
    return out


_GLOBAL_SOURCES = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "final_layernorm.weight": "decoder.final_layernorm.weight",
    "final_layernorm.bias": "decoder.final_layernorm.bias",
    "output_layer.weight": "output_layer.weight",
}


def split_part(tensor: torch.Tensor, part: str, cfg: ModelConfig) -> torch.Tensor:
    """One of q, k, v of a fused per-group QKV weight or bias (rows first), or gate / up of a
    fused SwiGLU fc1; the tensor itself for ''."""
    if part in ("q", "k", "v"):
        groups, per_group, d = cfg.query_groups, cfg.heads_per_group, cfg.head_dim
        blocks = tensor.reshape(groups, per_group + 2, d, *tensor.shape[1:])
        picked = {"q": blocks[:, :per_group], "k": blocks[:, per_group], "v": blocks[:, -1]}[part]
        return picked.reshape(-1, *tensor.shape[1:])
    if part in ("gate", "up"):
        half = tensor.shape[0] // 2
        return tensor[:half] if part == "gate" else tensor[half:]
    return tensor


def join_parts(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The inverse of split_part: megatron-core's fused tensor from its parts ({'': t}, q/k/v
    or gate/up)."""
    if "q" in parts:
        groups, d = cfg.query_groups, cfg.head_dim
        rest = parts["q"].shape[1:]
        q = parts["q"].reshape(groups, cfg.heads_per_group, d, *rest)
        k = parts["k"].reshape(groups, 1, d, *rest)
        v = parts["v"].reshape(groups, 1, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
    if "gate" in parts:
        return torch.cat([parts["gate"], parts["up"]], dim=0)
    return parts[""]


def megatron_layer_parts(
    cfg: ModelConfig, moe: bool, every_name: bool = False
) -> dict[str, dict[tuple, str]]:
    """megatron-core's layer-stacked key (its canonical name; with `every_name` its other
    names too) -> {(expert or None, part): our tensor within a layer}, for a dense layer or an
    MoE one. Multi-latent attention's norms are named differently by megatron-core's
    TransformerEngine layers and its local ones (which map no names for MLA): a checkpoint
    written under both names loads into either."""
    out: dict[str, dict[tuple, str]] = {}
    for ours, sources in layer_sources(cfg, moe).items():
        for key, part, expert in sources if every_name else sources[:1]:
            out.setdefault(key, {})[(expert, part)] = ours
    return out


class MegatronCheckpoint:
    """Lazy access to the tensors of a Megatron-LM torch_dist iteration folder."""

    def __init__(self, path: str):
        self.path = path
        self.reader = SafeFileSystemReader(path)
        self.reader.foreign = True
        try:
            self.metadata = self.reader.read_metadata()
        except CheckpointError as err:
            raise InputError(str(err)) from None
        self.stored = self.metadata.state_dict_metadata

    def read(self, key: str, index: int | tuple[int, ...] | None = None) -> torch.Tensor:
        """The whole tensor `key`, or the slice at `index` of its leading axes (a layer of a
        layer-stacked tensor, or (layer, expert) of stacked experts): only its bytes are
        read."""
        from engine.checkpoint.load import read_tensors
        from parallel.checkpoint.dcp import BoxTensor

        index = as_index(index)
        entry = self.stored[key]
        shape, dtype = tuple(entry.size), entry.properties.dtype
        if not index:
            value = torch.empty(shape, dtype=dtype)
            read_tensors(self.path, {key: value}, reader=self.reader, local=True)
            return value
        lead = len(index)
        value = torch.empty((1,) * lead + shape[lead:], dtype=dtype)
        offset = index + (0,) * (len(shape) - lead)
        box = BoxTensor(torch.Size(shape), dtype, [(offset, value)])
        read_tensors(self.path, {key: box}, reader=self.reader, local=True)
        return value.reshape(shape[lead:])

    def logical(self, plan_entry: tuple[str, tuple[int, ...], str], cfg: ModelConfig):
        """One of our tensors, whole, from its plan entry (see tensor_plan)."""
        key, index, part = plan_entry
        return split_part(self.read(key, index), part, cfg).contiguous()

    def tensor_plan(self, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """Our checkpoint key -> (megatron-core key, index into its leading axes (layer,
        expert), part), checked present. The layers' tensors are read from layer-stacked keys,
        or from per-layer ones (`decoder.layers.<i>.`) where the checkpoint has those."""
        plan = {}
        names = ["embedding.word_embeddings.weight", "final_layernorm.weight"]
        if cfg.position_embedding_type == "learned_absolute":
            names.append("embedding.position_embeddings.weight")
        if cfg.normalization == "LayerNorm":
            names.append("final_layernorm.bias")
        if cfg.untie_embeddings_and_output_weights:
            names.append("output_layer.weight")
        for name in names:
            plan[f"model/{name}"] = (self._present(_GLOBAL_SOURCES[name]), (), "")
        per_layer = any(k.startswith("decoder.layers.0.") for k in self.stored)
        pattern = cfg.moe_layer_pattern(cfg.num_layers)
        kinds = {is_moe: layer_sources(cfg, bool(is_moe)) for is_moe in set(pattern)}
        for layer, is_moe in enumerate(pattern):
            for ours, sources in kinds[is_moe].items():
                found = [
                    (key, part, expert)
                    for stacked, part, expert in sources
                    for key in [stacked.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)]
                    if per_layer
                ] or sources
                key, part, expert = next(
                    (source for source in found if source[0] in self.stored), found[0]
                )
                self._present(key)
                index = () if per_layer else (layer,)
                plan[f"model/layers.{layer}.{ours}"] = (key, index + as_index(expert), part)
        for depth in range(cfg.mtp_depths):  # built as the decoder's last layer, keyed per depth
            for ours, key in mtp_depth_keys(cfg, depth).items():
                plan[f"model/{ours}"] = (self._present(key), (), "")
            prefix = f"mtp.layers.{depth}.transformer_layer"
            for ours, sources in kinds[pattern[-1]].items():
                found = [(mtp_layer_key(key, depth), part, e) for key, part, e in sources]
                key, part, expert = next((f for f in found if f[0] in self.stored), found[0])
                plan[f"model/{prefix}.{ours}"] = (self._present(key), as_index(expert), part)
        return plan

    def _present(self, key: str) -> str:
        if key not in self.stored:
            raise InputError(
                f"{self.path}: no tensor {key}; not a megatron-core GPT checkpoint of this "
                "model (check the model flags or the saved arguments)"
            )
        return key
