"""Megatron-LM `torch_dist` checkpoints of GPT models (megatron-core's layout) -> ours.

A Megatron-LM checkpoint folder `iter_NNNNNNN/` holds `metadata.json` (the backend),
`.metadata` and `*.distcp` (torch.distributed.checkpoint: every tensor stored by its global
shape, so whatever TP/PP it was saved with), and `common.pt` (a torch.save of what is not
sharded: Megatron-LM's arguments, the iteration; newer megatron-core keeps it inside, as the
entry `common_state`). Nothing of it runs code here: `.metadata` is unpickled with DCP's own
classes only (byte entries, TransformerEngine's `_extra_state`, are dropped unread), and the
common state with torch's weights-only loader and an exact allow-list
(engine/compat/megatron_common.py); anything else it names is refused in one line.

The layer tensors carry the layer as their first dimension. megatron-core fuses, per query
group, the group's query heads, then its key head, then its value head into `linear_qkv`, and
SwiGLU's gate and up projections (all of the gate, then all of up) into `linear_fc1`; they are
taken apart into our q, k, v and gate, up. Norm weights keep their values (with
--apply-layernorm-1p both store them centred on zero).

What is read: the model weights, the model's shape (from the saved arguments, or the flags
when there are none), the iteration and consumed samples, and Adam's state where megatron-core
saved it per parameter (engine/compat/megatron_optimizer.py). Random states are not read.
"""

from __future__ import annotations

import json
import os

import torch

from engine.compat.megatron_common import read_common
from engine.config import ModelConfig
from engine.errors import InputError
from parallel.dcp import SafeFileSystemReader
from parallel.errors import CheckpointError

# Megatron-LM's arguments it checks against a checkpoint's on load (with --vocab-file), kept
# on import so that an export back to Megatron-LM passes that check.
_ROUND_TRIP_ARGS = (
    "make_vocab_size_divisible_by",
    "tokenizer_type",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
)


def is_megatron_checkpoint(path: str) -> bool:
    """An iteration folder Megatron-LM wrote with --ckpt-format torch_dist."""
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def _latest_iteration(root: str) -> int | None:
    """The iteration Megatron-LM's latest_checkpointed_iteration.txt names, or None."""
    try:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def model_config_from_args(args) -> ModelConfig:
    """Our ModelConfig from Megatron-LM's saved arguments (the padded vocabulary is the
    vocabulary: Megatron-LM's softmax runs over every padded row too)."""
    get = vars(args).get
    swiglu = bool(get("swiglu"))
    position = get("position_embedding_type") or "learned_absolute"
    normalization = get("normalization") or "LayerNorm"
    if position not in ("learned_absolute", "rope") or normalization not in (
        "LayerNorm",
        "RMSNorm",
    ):
        raise InputError(
            f"the checkpoint's model uses --position-embedding-type {position} and "
            f"--normalization {normalization}; only learned_absolute/rope and LayerNorm/RMSNorm "
            "are available here"
        )
    unsupported = {
        "window_attn_skip_freq": get("window_attn_skip_freq"),
        "rotary_interleaved": get("rotary_interleaved"),
        "squared_relu": get("squared_relu"),
        "apply_residual_connection_post_layernorm": get("apply_residual_connection_post_layernorm"),
    }
    for name, used in unsupported.items():
        if used:
            raise InputError(
                f"the checkpoint's model uses --{name.replace('_', '-')}, which this engine's "
                "model does not have yet; it cannot be loaded as the same model"
            )
    if get("num_experts"):
        raise InputError(
            "the checkpoint's model has mixture-of-experts layers (--num-experts), which are "
            "not available in this engine yet"
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
        normalization=normalization,
        norm_epsilon=float(get("norm_epsilon") or 1e-5),
        apply_layernorm_1p=bool(get("apply_layernorm_1p")),
        swiglu=swiglu,
        openai_gelu=bool(get("openai_gelu")),
        add_bias_linear=bool(get("add_bias_linear", True)),
        add_qkv_bias=bool(get("add_qkv_bias")),
        window_size=str(tuple(get("window_size"))) if get("window_size") else None,
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights")),
        qk_layernorm=bool(get("qk_layernorm")),
        hidden_dropout=float(get("hidden_dropout") or 0.0),
        attention_dropout=float(get("attention_dropout") or 0.0),
        init_method_std=float(get("init_method_std") or 0.02),
    )


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
    if cfg.swiglu:
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
        if cfg.swiglu:
            out["mlp.linear_fc1.bias.gate"] = [(f"{mlp}.linear_fc1.bias", "gate")]
            out["mlp.linear_fc1.bias.up"] = [(f"{mlp}.linear_fc1.bias", "up")]
        else:
            out["mlp.linear_fc1.bias"] = [(f"{mlp}.linear_fc1.bias", "")]
    if cfg.qk_layernorm:
        for norm in ("q_layernorm", "k_layernorm"):
            out[f"self_attention.{norm}.weight"] = [(f"{attn}.{norm}.weight", "")]
            if cfg.normalization == "LayerNorm":
                out[f"self_attention.{norm}.bias"] = [(f"{attn}.{norm}.bias", "")]
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


def megatron_layer_keys(cfg: ModelConfig) -> dict[str, dict[str, str]]:
    """megatron-core's layer-stacked key (the name its checkpoints use, TransformerEngine's
    and the local layers' alike) -> {part: our tensor within the layer}."""
    out: dict[str, dict[str, str]] = {}
    for ours, sources in _layer_sources(cfg).items():
        key, part = sources[0]
        out.setdefault(key, {})[part] = ours
    return out


class MegatronCheckpoint:
    """Lazy access to the tensors of a Megatron-LM torch_dist iteration folder."""

    def __init__(self, path: str):
        self.path = path
        self.reader = SafeFileSystemReader(path)
        self.reader.foreign = True
        try:
            self.stored = self.reader.read_metadata().state_dict_metadata
        except CheckpointError as err:
            raise InputError(str(err)) from None

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The whole tensor `key`, or one layer of a layer-stacked one (only that layer's
        bytes are read)."""
        from engine.checkpoint_load import read_tensors
        from parallel.dcp import BoxTensor

        entry = self.stored[key]
        shape, dtype = tuple(entry.size), entry.properties.dtype
        if layer is None:
            value = torch.empty(shape, dtype=dtype)
            read_tensors(self.path, {key: value}, reader=self.reader, local=True)
            return value
        value = torch.empty((1, *shape[1:]), dtype=dtype)
        offset = (layer,) + (0,) * (len(shape) - 1)
        box = BoxTensor(torch.Size(shape), dtype, [(offset, value)])
        read_tensors(self.path, {key: box}, reader=self.reader, local=True)
        return value[0]

    def logical(self, plan_entry: tuple[str, int | None, str], cfg: ModelConfig) -> torch.Tensor:
        """One of our tensors, whole, from its plan entry (see tensor_plan)."""
        key, layer, part = plan_entry
        return split_part(self.read(key, layer), part, cfg).contiguous()

    def tensor_plan(self, cfg: ModelConfig) -> dict[str, tuple[str, int | None, str]]:
        """Our checkpoint key -> (megatron-core key, layer or None, part), checked present."""
        plan = {}
        names = ["embedding.word_embeddings.weight", "final_layernorm.weight"]
        if cfg.position_embedding_type == "learned_absolute":
            names.append("embedding.position_embeddings.weight")
        if cfg.normalization == "LayerNorm":
            names.append("final_layernorm.bias")
        if cfg.untie_embeddings_and_output_weights:
            names.append("output_layer.weight")
        for name in names:
            plan[f"model/{name}"] = (self._present(_GLOBAL_SOURCES[name]), None, "")
        for ours, sources in _layer_sources(cfg).items():
            key = next((k for k, _ in sources if k in self.stored), None)
            if key is None:
                self._present(sources[0][0])
            part = dict(sources)[key]
            for layer in range(cfg.num_layers):
                plan[f"model/layers.{layer}.{ours}"] = (key, layer, part)
        return plan

    def _present(self, key: str) -> str:
        if key not in self.stored:
            raise InputError(
                f"{self.path}: no tensor {key}; not a megatron-core GPT checkpoint of this "
                "model (check the model flags or the saved arguments)"
            )
        return key


def import_from_megatron(
    path: str,
    output: str,
    cfg: ModelConfig | None = None,
    tp: int = 1,
    pp: int = 1,
    load_optim: bool = True,
) -> dict:
    """Write our checkpoint folder `output` from the Megatron-LM iteration folder `path` (or
    a checkpoint root, whose latest iteration is taken): the model weights at Megatron-LM's
    iteration and consumed samples, the learning-rate schedule's position, and Adam's state
    when the checkpoint holds it in model space (else, or without `load_optim`, a fresh
    optimizer). `cfg`: the model, when the common state holds no saved arguments."""
    import dataclasses

    from engine.checkpoint_convert import check_new_output, write_converted
    from engine.checkpoint_files import iteration_dir
    from engine.compat.megatron_optimizer import (
        check_optimizer_format,
        optimizer_key,
        optimizer_step,
    )
    from engine.hf.import_hf import expected_shapes
    from parallel.dcp import LazyTensor
    from parallel.pipeline.layout import stage_layers

    output = check_new_output(output)
    if not is_megatron_checkpoint(path):
        latest = _latest_iteration(path)
        if latest is None or not is_megatron_checkpoint(iteration_dir(path, latest)):
            raise InputError(
                f"{path}: not a Megatron-LM torch_dist checkpoint (no metadata.json naming the "
                "torch_dist backend, here or in the iteration its latest file names)"
            )
        path = iteration_dir(path, latest)
    common = read_common(path)
    args = common.get("args")
    if args is not None:
        cfg = model_config_from_args(args)
    elif cfg is None:
        raise InputError(
            f"{path}/common.pt holds no saved arguments; give the model's flags (--num-layers, "
            "--hidden-size, ...) to describe it"
        )
    cfg.validate(tp)
    for rank in range(pp):
        stage_layers(cfg.num_layers, pp, rank)
    source = MegatronCheckpoint(path)
    expected = expected_shapes(cfg)
    state = {}
    for ours, (key, layer, part) in source.tensor_plan(cfg).items():
        entry = source.stored[key]
        whole = tuple(entry.size)[1:] if layer is not None else tuple(entry.size)
        probe = split_part(torch.empty(whole, device="meta"), part, cfg)
        if tuple(probe.shape) != expected[ours]:
            raise InputError(
                f"{path}: tensor {key} gives {ours.removeprefix('model/')} the shape "
                f"{list(probe.shape)}, but the model has {list(expected[ours])}; the weights "
                "do not belong to this model"
            )

        def load(entry=(key, layer, part)):
            return source.logical(entry, cfg)

        state[ours] = LazyTensor(torch.Size(expected[ours]), entry.properties.dtype, load)
    step = 0
    if load_optim and check_optimizer_format(path, common, source.stored):
        step = optimizer_step(common)
        for ours, (key, layer, part) in source.tensor_plan(cfg).items():
            name = ours.removeprefix("model/")
            for kind in ("exp_avg", "exp_avg_sq", "master"):
                stored = optimizer_key(source.stored, kind, key)
                if stored is None and kind == "master":
                    continue  # the master starts from the weights
                if stored is None:
                    raise InputError(f"{path}: its optimizer state has no {kind} for {key}")

                def load_state(entry=(stored, layer, part)):
                    return source.logical(entry, cfg)

                dtype = source.stored[stored].properties.dtype
                state[f"optim/{name}/{kind}"] = LazyTensor(
                    state[ours].global_shape, dtype, load_state
                )
    iteration = int(common.get("iteration", 0) or 0)
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0) if args else 0
    schedule = common.get("opt_param_scheduler") or {}
    dtypes = {
        str(v.dtype).replace("torch.", "") for k, v in state.items() if k.startswith("model/")
    }

    def meta(files: dict) -> dict:
        return {
            "iteration": iteration,
            "consumed_samples": consumed,
            "layout": {"tp": tp, "pp": pp, "dp": 1, "virtual": 1, "distributed_optimizer": False},
            "model": dataclasses.asdict(cfg),
            "dtype": dtypes.pop() if len(dtypes) == 1 else "float32",
            "tokenizer": None,
            # Megatron-LM's schedule counts samples; its updates are the iterations
            "scheduler": {
                "num_steps": iteration,
                "num_samples": int(schedule.get("num_steps", consumed)),
            },
            "grad_scaler": None,
            "optimizer_step": step,
            "counters": {"skipped_iters": 0, "nan_iters": 0},
            "spikes": {},
            "source": {
                "megatron_checkpoint": os.path.abspath(path),
                # what Megatron-LM compares on load, written back by --to-megatron
                "megatron_args": {
                    name: getattr(args, name, None)
                    for name in _ROUND_TRIP_ARGS
                    if isinstance(getattr(args, name, None), str | int | float | bool)
                },
            },
            "files": files,
        }

    folder = write_converted(output, iteration, state, meta)
    return {"tensors": len(state), "checkpoint": folder, "iteration": iteration}


def megatron_latest(root: str | None) -> str | None:
    """The latest iteration folder of `root` when Megatron-LM wrote it (torch_dist), else
    None (ours, or nothing there)."""
    from engine.checkpoint_files import META, iteration_dir

    iteration = _latest_iteration(root) if root else None
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    if os.path.isfile(os.path.join(path, META)) or not is_megatron_checkpoint(path):
        return None
    return path


def megatron_progress(path: str) -> dict:
    """Iteration, consumed samples and the learning-rate schedule's samples of a Megatron-LM
    checkpoint (from common.pt; zeros where it holds none)."""
    common = read_common(path)
    args = common.get("args")
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0) if args is not None else 0
    schedule = common.get("opt_param_scheduler") or {}
    return {
        "iteration": int(common.get("iteration", 0) or 0),
        "consumed_samples": consumed,
        "schedule_samples": int(schedule.get("num_steps", consumed) or 0),
        "args": args,
    }


def _fill(source: MegatronCheckpoint, key: str, entry: tuple, boxes, cfg: ModelConfig) -> None:
    """Copy megatron-core's tensor `entry` (key, layer, part) into the boxes of our `key`."""
    full = source.logical(entry, cfg)
    if tuple(full.shape) != tuple(boxes.global_shape):
        raise InputError(
            f"{source.path}: {entry[0]} gives {key.removeprefix('model/')} the shape "
            f"{list(full.shape)}, but the model has {list(boxes.global_shape)}; the flags "
            "describe another model (--use-checkpoint-args takes the saved one)"
        )
    for offset, tensor in boxes.boxes:
        region = tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape))
        tensor.copy_(full[region])


def load_weights(path: str, chunks, cfg: ModelConfig, optimizer=None) -> int | None:
    """Fill this rank's model chunks (any TP/PP/virtual layout) with the weights of the
    Megatron-LM iteration folder `path`, one tensor (one layer of it) at a time; with
    `optimizer`, also its Adam state when the checkpoint holds it in model space (see
    engine/compat/megatron_optimizer.py). Returns Adam's step when optimizer state was read."""
    from engine.checkpoint_state import model_state, optimizer_state, prime_optimizer_state
    from engine.compat.megatron_optimizer import (
        check_optimizer_format,
        check_state_kinds,
        optimizer_key,
        optimizer_step,
    )

    source = MegatronCheckpoint(path)
    plan = source.tensor_plan(cfg)
    for key, boxes in model_state(chunks, for_save=False).items():
        if key not in plan:
            raise InputError(f"{path}: nothing in it gives {key.removeprefix('model/')}")
        _fill(source, key, plan[key], boxes, cfg)
    for piece in optimizer.pieces if optimizer is not None else ():
        if piece.master is not piece.data:
            piece.master.copy_(piece.data)
    common = read_common(path)
    if optimizer is None or not check_optimizer_format(path, common, source.stored):
        return None
    prime_optimizer_state(optimizer)
    wanted = optimizer_state(optimizer, chunks, for_save=False)
    check_state_kinds(path, {key.rsplit("/", 1)[1] for key in wanted})
    for key, boxes in wanted.items():
        name, kind = key.removeprefix("optim/").rsplit("/", 1)
        model_key, layer, part = plan[f"model/{name}"]
        stored = optimizer_key(source.stored, kind, model_key)
        if stored is None and kind == "master":
            continue  # the master starts from the weights, as Megatron-LM's fp32 runs have it
        if stored is None:
            raise InputError(f"{path}: its optimizer state has no {kind} for {model_key}")
        _fill(source, key, (stored, layer, part), boxes, cfg)
    step = optimizer_step(common)
    for piece in optimizer.pieces:
        entry = optimizer.optimizer.state.get(piece.master, {})
        if torch.is_tensor(entry.get("step")):
            entry["step"].fill_(float(step))
    return step
