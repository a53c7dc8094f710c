"""Our checkpoints -> Megatron-LM `torch_dist` checkpoints (megatron-core's GPT layout).

The output is a Megatron-LM checkpoint root: `latest_checkpointed_iteration.txt` and
`iter_NNNNNNN/` with `metadata.json` (the torch_dist backend), `.metadata` and `*.distcp`
(torch.distributed.checkpoint, every tensor under megatron-core's key at its global shape, the
layer tensors stacked along a first layer dimension, so Megatron-LM loads it under any TP/PP;
a mixture of experts' experts stacked along a second, expert dimension, and with dense layers
among the MoE ones every layer's tensors under per-layer keys, as megatron-core keys them then),
and `common.pt`: Megatron-LM's arguments (an argparse.Namespace naming the model, so
`--use-checkpoint-args` works), the iteration and checkpoint version 3.0.

q, k, v are fused per query group into `linear_qkv` and SwiGLU's gate and up into
`linear_fc1`, as megatron-core stores them; norm weights take the names its saved layout uses
(`linear_qkv.layer_norm_weight`, ...). The vocabulary is padded as Megatron-LM pads it
(--make-vocab-size-divisible-by x the tensor-parallel size given here), with zero rows. Every
linear layer gets the empty `_extra_state` entry (TransformerEngine's included) that a run
without FP8 saves.

Written: the model weights, iteration and consumed samples. Not written: optimizer state,
learning-rate schedule and random states, so Megatron-LM continues with `--no-load-optim
--no-load-rng` (same iteration and samples, fresh optimizer) or starts over with `--finetune`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings

import torch

from engine.config.model import ModelConfig
from engine.config.rope_scaling import rope_scaling_of
from engine.errors import ConfigError, InputError, UserError
from engine.interop.megatron.latent_layout import (
    latent_args,
    latent_extra_state_modules,
    mtp_depth_keys,
    mtp_layer_key,
)
from engine.interop.megatron.layout import join_parts, megatron_layer_parts
from parallel.errors import describe_os_error, root_cause

# megatron-core's linear layers and TransformerEngine's attention each save an _extra_state
_ATTENTION_EXTRA_STATE = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.core_attention",
)
_MLP_EXTRA_STATE = ("mlp.linear_fc1", "mlp.linear_fc2")
_GLOBAL_KEYS = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "final_layernorm.weight": "decoder.final_layernorm.weight",
    "final_layernorm.bias": "decoder.final_layernorm.bias",
    "output_layer.weight": "output_layer.weight",
}
_PADDED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _gelu_args(cfg: ModelConfig) -> dict:
    """Megatron-LM's arguments for our GELU: its models compute GELU's tanh approximation only
    through the fused bias-GELU, with linear biases (its --openai-gelu reaches only its legacy
    models)."""
    gelu = not (cfg.gated_linear_unit or cfg.squared_relu)
    fused = cfg.bias_gelu_fusion and cfg.add_bias_linear
    if gelu and cfg.gelu_tanh and not fused:
        raise ConfigError(
            "--openai-gelu without linear biases (or with --no-bias-gelu-fusion) has no "
            "Megatron-LM equivalent: its models compute GELU's tanh approximation only through "
            "the fused bias-GELU; export to Hugging Face instead (gelu_new)"
        )
    return {"openai_gelu": cfg.openai_gelu, "bias_gelu_fusion": fused}


def _qk_layernorm(cfg: ModelConfig) -> bool:
    """--qk-layernorm; a norm over all heads at once has no Megatron-LM equivalent."""
    if cfg.qk_layernorm_across_heads:
        raise ConfigError(
            "--qk-layernorm-across-heads (OLMoE's query and key norms) has no Megatron-LM "
            "equivalent (its --qk-layernorm normalises each head); export to Hugging Face "
            "instead (OlmoeForCausalLM)"
        )
    return cfg.qk_layernorm


def _rope_scaling_args(cfg: ModelConfig) -> dict:
    """Megatron-LM's arguments for our RoPE scaling (whichever flags asked for it)."""
    if cfg.multi_latent_attention:  # its RoPE is its own (latent_layout.py: latent_args)
        return {
            "position_embedding_type": "rope",
            "use_rope_scaling": False,
            "rope_scaling_factor": cfg.rope_scaling_factor,
            "rotary_seq_len_interpolation_factor": None,
        }
    scaling = rope_scaling_of(cfg) or {"rope_type": None}
    kind = scaling["rope_type"]
    if kind == "dynamic":
        raise ConfigError(
            "--rope-scaling-type dynamic has no Megatron-LM equivalent; export to Hugging "
            "Face instead (rope_type dynamic)"
        )
    args = {
        "position_embedding_type": "yarn" if kind == "yarn" else cfg.position_embedding_type,
        "use_rope_scaling": kind == "llama3",
        "rope_scaling_factor": scaling["factor"] if kind == "llama3" else cfg.rope_scaling_factor,
        "rotary_seq_len_interpolation_factor": scaling["factor"] if kind == "linear" else None,
    }
    if kind == "yarn":
        args |= {
            "rotary_scaling_factor": scaling["factor"],
            "yarn_original_max_position_embeddings": scaling["original_max_position_embeddings"],
            "yarn_beta_fast": scaling["beta_fast"],
            "yarn_beta_slow": scaling["beta_slow"],
            "mscale": scaling["mscale"],
            "mscale_all_dim": scaling["mscale_all_dim"],
            "yarn_correction_range_round_to_int": scaling["truncate"],
        }
    return args


def _gpt_oss_args(cfg: ModelConfig) -> dict:
    """Megatron-LM's arguments for gpt-oss's attention and MLP (our fields have its names;
    --window-attn-skip-freq as it parses it: an integer, or the 0/1 list per layer)."""
    skip = cfg.window_attn_skip_freq
    if skip is not None:
        skip = int(skip) if str(skip).strip().isdigit() else cfg.windowed_layers()
    return {
        "window_attn_skip_freq": skip,
        "softmax_type": cfg.softmax_type,
        "quick_geglu": cfg.quick_geglu,
        "glu_linear_offset": cfg.glu_linear_offset,
        "activation_func_clamp_value": cfg.activation_func_clamp_value,
    }


def _moe_args(cfg: ModelConfig) -> dict:
    """Megatron-LM's MoE arguments (our fields have its names): --moe-layer-freq as it parses
    it (1, or the list of 0/1 per layer), its multi-valued flags single values when one."""
    if not cfg.is_moe:
        return {"num_experts": None}
    from dataclasses import fields

    from engine.config.moe import MoEOptions

    out = {field.name: getattr(cfg, field.name) for field in fields(MoEOptions)}
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    out["moe_layer_freq"] = 1 if all(pattern) else pattern
    out["moe_ffn_hidden_size"] = cfg.expert_ffn_size
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if len(out[name]) == 1:
            out[name] = out[name][0]
    return out


def megatron_args(cfg: ModelConfig, meta: dict, padded_vocab: int, tp: int) -> argparse.Namespace:
    """Megatron-LM's arguments for this model, as its training saves them in common.pt (the
    model's, the run's progress and precision, and the layout it is written for)."""
    dtype = meta.get("dtype", "float32")
    rope = cfg.uses_rope
    tokenizer = meta.get("tokenizer") or {}
    # A checkpoint imported from Megatron-LM gives back the values Megatron-LM compares on load.
    kept = ((meta.get("source") or {}).get("megatron_args") or {}) if not tokenizer else {}
    args = argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.group_query_attention,
        num_query_groups=cfg.num_query_groups if cfg.group_query_attention else None,
        kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.max_positions,
        add_position_embedding=not rope,
        use_rotary_position_embeddings=rope,
        rotary_base=cfg.rotary_base,
        rotary_percent=cfg.rotary_percent,
        rotary_interleaved=cfg.rotary_interleaved,
        window_size=None if cfg.attention_window is None else (cfg.attention_window, 0),
        **_gpt_oss_args(cfg),
        **_rope_scaling_args(cfg),
        normalization=cfg.normalization,
        norm_epsilon=cfg.norm_epsilon,
        apply_layernorm_1p=cfg.apply_layernorm_1p,
        swiglu=cfg.swiglu,
        **_gelu_args(cfg),
        squared_relu=cfg.squared_relu,
        add_bias_linear=cfg.add_bias_linear,
        # (megatron-core's fused QKV takes --add-bias-linear's biases too; MLA has none)
        add_qkv_bias=(cfg.add_bias_linear or cfg.add_qkv_bias) and not cfg.multi_latent_attention,
        qk_layernorm=_qk_layernorm(cfg),
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        apply_query_key_layer_scaling=False,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab,
        tokenizer_type=tokenizer.get("tokenizer_type"),
        tokenizer_model=tokenizer.get("tokenizer_model"),
        vocab_file=tokenizer.get("vocab_file"),
        merge_file=tokenizer.get("merge_file"),
        tiktoken_pattern=tokenizer.get("tiktoken_pattern"),
        **_moe_args(cfg),
        **latent_args(cfg),
        fp16=dtype == "float16",
        bf16=dtype == "bfloat16",
        params_dtype=getattr(torch, dtype),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        ckpt_format="torch_dist",
        iteration=meta["iteration"],
        consumed_train_samples=meta["consumed_samples"],
        consumed_valid_samples=(meta.get("counters") or {}).get("consumed_valid_samples", 0),
    )
    for name, value in kept.items():
        setattr(args, name, value)
    return args


def _state(path: str, reader, stored, meta: dict, cfg: ModelConfig, padded_vocab: int) -> dict:
    """megatron-core key -> LazyTensor / LazyLayers (or [None] for an _extra_state entry), each
    tensor read from our checkpoint only when the writer reaches it (a weight's master where
    the run gathered its weights in FP8: engine/interop/hf/export.read_weight)."""
    from engine.interop.hf.export import read_weight
    from parallel.checkpoint.dcp import LazyLayers, LazyTensor

    def ours(name: str) -> torch.Tensor:
        key = f"model/{name}"
        if key not in stored:
            raise InputError(f"{path}: tensor {name} is missing; the checkpoint is incomplete")
        return read_weight(path, key, stored, meta, reader)

    def entry_of(name: str):
        if f"model/{name}" not in stored:
            raise InputError(f"{path}: tensor {name} is missing; the checkpoint is incomplete")
        return stored[f"model/{name}"]

    state: dict = {}
    for name, key in _GLOBAL_KEYS.items():
        if f"model/{name}" not in stored:
            continue
        entry = entry_of(name)
        shape = list(entry.size)
        if name in _PADDED:
            shape[0] = padded_vocab

        def load(name=name, rows=shape[0]):
            value = ours(name)
            if name not in _PADDED:
                return value
            return torch.nn.functional.pad(value, (0, 0, 0, rows - value.shape[0]))

        state[key] = LazyTensor(torch.Size(shape), entry.properties.dtype, load)
    layers = cfg.num_layers
    pattern = cfg.moe_layer_pattern(layers)

    def joined(layer: int, parts: dict) -> torch.Tensor:
        """megatron-core's tensor of one layer from ours: fused parts, experts stacked."""
        experts = sorted({expert for expert, _ in parts}, key=lambda e: -1 if e is None else e)
        stacked = [
            join_parts(
                {p: ours(f"layers.{layer}.{n}") for (e, p), n in parts.items() if e == expert},
                cfg,
            )
            for expert in experts
        ]
        return (stacked[0] if experts == [None] else torch.stack(stacked)).contiguous()

    def layer_shape(layer: int, parts: dict):
        probes = {p: torch.empty(tuple(entry_of(f"layers.{layer}.{n}").size), device="meta")
                  for (e, p), n in parts.items() if e == next(iter(parts))[0]}  # fmt: skip
        shape = tuple(join_parts(probes, cfg).shape)
        experts = {e for e, _ in parts}
        name = f"layers.{layer}.{next(iter(parts.values()))}"
        return (len(experts), *shape) if None not in experts else shape, entry_of(name)

    if all(pattern) or not any(pattern):  # one kind of layer: megatron-core stacks them
        for key, parts in megatron_layer_parts(cfg, cfg.is_moe, cfg.multi_latent_attention).items():
            shape, entry = layer_shape(0, parts)

            def load_layer(layer: int, parts=parts) -> torch.Tensor:
                return joined(layer, parts)

            dtype = entry.properties.dtype
            state[key] = LazyLayers(torch.Size([layers, *shape]), dtype, load_layer)
    else:  # dense and MoE layers: megatron-core keys each layer's tensors on their own
        for layer, is_moe in enumerate(pattern):
            for key, parts in megatron_layer_parts(
                cfg, bool(is_moe), cfg.multi_latent_attention
            ).items():
                shape, entry = layer_shape(layer, parts)

                def load(layer=layer, parts=parts) -> torch.Tensor:
                    return joined(layer, parts)

                mine = key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
                state[mine] = LazyTensor(torch.Size(shape), entry.properties.dtype, load)
    state |= _mtp_state(cfg, pattern, ours, entry_of)
    for key in _extra_state_keys(cfg, pattern):
        state[key] = [None]  # megatron-core stores each object as its values on the saving rank
    return state


def _mtp_state(cfg: ModelConfig, pattern: list[int], ours, entry_of) -> dict:
    """Multi-token prediction's tensors under megatron-core's keys (latent_layout.py): each
    depth's norms and projection, and its layer's tensors keyed per depth."""
    from parallel.checkpoint.dcp import LazyTensor

    state: dict = {}
    for depth in range(cfg.mtp_depths):
        for name, key in mtp_depth_keys(cfg, depth).items():
            entry = entry_of(name)
            state[key] = LazyTensor(
                torch.Size(entry.size), entry.properties.dtype, lambda name=name: ours(name)
            )
        prefix = f"mtp.layers.{depth}.transformer_layer"
        for key, parts in megatron_layer_parts(
            cfg, bool(pattern[-1]), cfg.multi_latent_attention
        ).items():
            experts = sorted({e for e, _ in parts}, key=lambda e: -1 if e is None else e)
            first = {p: n for (e, p), n in parts.items() if e == experts[0]}
            probes = {
                p: torch.empty(tuple(entry_of(f"{prefix}.{n}").size), device="meta")
                for p, n in first.items()
            }
            shape = tuple(join_parts(probes, cfg).shape)
            shape = shape if experts == [None] else (len(experts), *shape)

            def load(parts=parts, experts=experts, prefix=prefix) -> torch.Tensor:
                stacked = [
                    join_parts(
                        {p: ours(f"{prefix}.{n}") for (e, p), n in parts.items() if e == expert},
                        cfg,
                    )
                    for expert in experts
                ]
                return (stacked[0] if experts == [None] else torch.stack(stacked)).contiguous()

            dtype = entry_of(f"{prefix}.{next(iter(first.values()))}").properties.dtype
            state[mtp_layer_key(key, depth)] = LazyTensor(torch.Size(shape), dtype, load)
    return state


def _extra_state_keys(cfg: ModelConfig, pattern: list[int]) -> list[str]:
    """The `_extra_state` entries megatron-core's layers ask for: per layer (and per expert)
    of a stacked layout, or per layer key with dense and MoE layers mixed."""
    layers, experts = len(pattern), cfg.num_experts or 0
    stacked = all(pattern) or not any(pattern)
    out = []
    attention = _ATTENTION_EXTRA_STATE
    if cfg.multi_latent_attention:
        attention = tuple(latent_extra_state_modules(cfg))
    # the decoder's layers, then multi-token prediction's (keyed per depth, as the last)
    mtp = [(f"mtp.layers.{d}.transformer_layer.", pattern[-1]) for d in range(cfg.mtp_depths)]
    for layer, (prefix, is_moe) in enumerate(
        [("decoder.layers." if stacked else f"decoder.layers.{n}.", m) for n, m in
         enumerate(pattern)] + mtp
    ):  # fmt: skip
        own = layer >= layers or not stacked  # keyed on its own: no layer axis
        shard = "shard_0_1" if own else f"shard_{layer}_{layers}"
        modules = list(attention)
        if not is_moe:
            modules += _MLP_EXTRA_STATE
        elif cfg.moe_shared_expert_intermediate_size:
            modules += [f"mlp.shared_experts.linear_fc{n}" for n in (1, 2)]
        out += [f"{prefix}{module}._extra_state/{shard}" for module in modules]
        if is_moe:
            for n in (1, 2):
                for e in range(experts):
                    where = f"{e}_{experts}" if own else f"{layer}.{e}_{layers}.{experts}"
                    out.append(
                        f"{prefix}mlp.experts.experts.linear_fc{n}._extra_state/shard_{where}"
                    )
    out += [f"mtp.layers.{d}.eh_proj._extra_state/shard_0_1" for d in range(cfg.mtp_depths)]
    return out


def export_to_megatron(
    load: str, output: str, iteration: int | None = None, tp: int = 1, verify: bool = True
) -> dict:
    """Write the Megatron-LM checkpoint root `output` from our checkpoint `load` (its latest
    iteration, or `iteration`); `tp` is the tensor-parallel size the vocabulary is padded for.
    Returns a summary (tensors, iteration, folder)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from engine.checkpoint.convert import check_new_output
    from engine.checkpoint.load import open_checkpoint, verify_checkpoint
    from engine.interop.hf.export import checkpoint_path

    output = check_new_output(output)
    path = checkpoint_path(load, iteration)
    meta = verify_checkpoint(path, digests=verify)
    cfg = ModelConfig.from_record(meta["model"])
    scaling = (
        cfg.rope_scaling_low_freq_factor,
        cfg.rope_scaling_high_freq_factor,
        cfg.rope_scaling_original_max_position_embeddings,
    )
    if cfg.use_rope_scaling and scaling != (1.0, 4.0, 8192):
        raise InputError(
            f"{path}: the model's RoPE scaling has low/high frequency factors and original "
            f"length {scaling}; Megatron-LM's --use-rope-scaling fixes them at (1, 4, 8192), so "
            "it would not be the same model"
        )
    padded_vocab = cfg.padded_vocab_size(tp)
    reader = open_checkpoint(path)
    stored = reader.read_metadata().state_dict_metadata
    state = _state(path, reader, stored, meta, cfg, padded_vocab)
    number = int(meta["iteration"])
    staging = f"{output}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    folder = os.path.join(staging, f"iter_{number:07d}")
    try:
        os.makedirs(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is not initialized": on purpose
            from parallel.checkpoint.dcp import BoxSavePlanner

            dcp.save(state, storage_writer=FileSystemWriter(folder), planner=BoxSavePlanner(),
                     no_dist=True)  # fmt: skip
        common = {
            "args": megatron_args(cfg, meta, padded_vocab, tp),
            "iteration": number,
            "checkpoint_version": 3.0,
        }
        torch.save(common, os.path.join(folder, "common.pt"))
        backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}  # fmt: skip
        with open(os.path.join(folder, "metadata.json"), "w") as f:
            json.dump(backend, f)
        with open(os.path.join(staging, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(number))
        if os.path.isdir(output):
            os.rmdir(output)  # empty, checked above
        os.replace(staging, output)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        cause = root_cause(err)  # DCP wraps what went wrong in its own exception
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, OSError):
            raise InputError(describe_os_error(cause, cause.filename or output)) from None
        raise
    tensors = sum(not isinstance(v, list) for v in state.values())
    return {
        "tensors": tensors,
        "iteration": number,
        "checkpoint": os.path.join(output, f"iter_{number:07d}"),
    }
