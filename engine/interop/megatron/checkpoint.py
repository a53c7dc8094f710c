"""Megatron-LM `torch_dist` checkpoints of GPT models (megatron-core's layout) -> ours.

A Megatron-LM checkpoint folder `iter_NNNNNNN/` holds `metadata.json` (the backend),
`.metadata` and `*.distcp` (torch.distributed.checkpoint: every tensor stored by its global
shape, so whatever TP/PP it was saved with), and `common.pt` (a torch.save of what is not
sharded: Megatron-LM's arguments, the iteration; newer megatron-core keeps it inside, as the
entry `common_state`). Nothing of it runs code here: `.metadata` is unpickled with DCP's own
classes only (byte entries, TransformerEngine's `_extra_state`, are dropped unread), and the
common state with torch's weights-only loader and an exact allow-list
(engine/interop/megatron/common.py); anything else it names is refused in one line.

The tensors' names and fused layout are in engine/interop/megatron/layout.py. Norm weights
keep their values (with --apply-layernorm-1p both store them centred on zero).

What is read: the model weights, the model's shape (from the saved arguments, or the flags
when there are none), the iteration and consumed samples, and Adam's state in any of
megatron-core's current layouts (engine/interop/megatron/optimizer.py). Random states are not
read.
"""

from __future__ import annotations

import json
import os

import torch

from engine.config.model import ModelConfig
from engine.errors import InputError
from engine.interop.megatron.common import read_common
from engine.interop.megatron.layout import MegatronCheckpoint, model_config_from_args, split_part

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
    when the checkpoint holds it (else, or without `load_optim`, a fresh optimizer). `cfg`:
    the model, when the common state holds no saved arguments."""
    import dataclasses

    from engine.checkpoint.convert import check_new_output, write_converted
    from engine.checkpoint.files import iteration_dir
    from engine.interop.hf.import_hf import expected_shapes, frozen_parameters, meta_model
    from engine.interop.megatron.optimizer import optimizer_state
    from parallel.checkpoint.dcp import LazyTensor
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
    model = meta_model(cfg)
    expected = expected_shapes(model)
    state = {}
    for ours, (key, index, part) in source.tensor_plan(cfg).items():
        entry = source.stored[key]
        whole = tuple(entry.size)[len(index) :]
        probe = split_part(torch.empty(whole, device="meta"), part, cfg)
        if tuple(probe.shape) != expected[ours]:
            raise InputError(
                f"{path}: tensor {key} gives {ours.removeprefix('model/')} the shape "
                f"{list(probe.shape)}, but the model has {list(expected[ours])}; the weights "
                "do not belong to this model"
            )

        def load(entry=(key, index, part)):
            return source.logical(entry, cfg)

        state[ours] = LazyTensor(torch.Size(expected[ours]), entry.properties.dtype, load)
    step = 0
    reader = optimizer_state(source, common, cfg) if load_optim else None
    if reader is not None:
        step = reader.step
        kinds = ("exp_avg", "exp_avg_sq") + (("master",) if reader.has_master else ())
        frozen = frozen_parameters(model)
        for ours, (key, index, part) in source.tensor_plan(cfg).items():
            name = ours.removeprefix("model/")
            if name in frozen:
                continue
            for kind in kinds:

                def load_state(entry=(kind, key, index), part=part):
                    full = reader.read(*entry)
                    if full is None:  # a tensor without a master: it starts from the weights
                        full = source.read(*entry[1:]).float()
                    return split_part(full, part, cfg).contiguous()

                state[f"optim/{name}/{kind}"] = LazyTensor(
                    state[ours].global_shape, torch.float32, load_state
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
            # Megatron-LM's schedule counts samples; its updates are the iterations; its shape
            # (max_lr, lr_decay_steps, ...) has the names ours has, compared on resume
            "scheduler": {
                **{key: value for key, value in schedule.items() if key != "num_steps"},
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
    from engine.checkpoint.files import META, iteration_dir

    iteration = _latest_iteration(root) if root else None
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    if os.path.isfile(os.path.join(path, META)) or not is_megatron_checkpoint(path):
        return None
    return path


def megatron_progress(path: str) -> dict:
    """Iteration, consumed samples, the learning-rate schedule's samples and its state (its
    shape under megatron-core's names) of a Megatron-LM checkpoint (from common.pt; zeros and
    an empty state where it holds none)."""
    common = read_common(path)
    args = common.get("args")
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0) if args is not None else 0
    schedule = common.get("opt_param_scheduler") or {}
    return {
        "iteration": int(common.get("iteration", 0) or 0),
        "consumed_samples": consumed,
        "schedule_samples": int(schedule.get("num_steps", consumed) or 0),
        "schedule": schedule,
        "args": args,
    }


def _fill(full: torch.Tensor, key: str, boxes, path: str) -> None:
    """Copy the whole tensor `full` (megatron-core's, as ours) into the boxes of our `key`."""
    if tuple(full.shape) != tuple(boxes.global_shape):
        raise InputError(
            f"{path}: gives {key.removeprefix('model/')} the shape {list(full.shape)}, but the "
            f"model has {list(boxes.global_shape)}; the flags describe another model "
            "(--use-checkpoint-args takes the saved one)"
        )
    for offset, tensor in boxes.boxes:
        region = tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape, strict=False))
        tensor.copy_(full[region])


def load_weights(
    path: str, chunks, cfg: ModelConfig, optimizer=None, load_optimizer: bool = True
) -> int | None:
    """Fill this rank's model chunks (any TP/PP/virtual layout) with the weights of the
    Megatron-LM iteration folder `path`, one tensor (one layer of it) at a time, and the
    `optimizer`'s fp32 master weights (where they are copies of bf16/fp16 weights) with them;
    with `load_optimizer`, also its Adam state (see engine/interop/megatron/optimizer.py).
    Returns Adam's step when optimizer state was read."""
    from engine.checkpoint.state import model_state, optimizer_state, prime_optimizer_state
    from engine.interop.megatron.optimizer import check_state_kinds
    from engine.interop.megatron.optimizer import optimizer_state as megatron_optimizer_state

    source = MegatronCheckpoint(path)
    plan = source.tensor_plan(cfg)
    for key, boxes in model_state(chunks, for_save=False).items():
        if key not in plan:
            raise InputError(f"{path}: nothing in it gives {key.removeprefix('model/')}")
        _fill(source.logical(plan[key], cfg), key, boxes, path)
    for piece in optimizer.pieces if optimizer is not None else ():
        if piece.master is not piece.data:
            piece.master.copy_(piece.data)
    reader = None
    if optimizer is not None and load_optimizer:
        reader = megatron_optimizer_state(source, read_common(path), cfg)
    if reader is None:
        return None
    prime_optimizer_state(optimizer)
    wanted = optimizer_state(optimizer, chunks, for_save=False)
    check_state_kinds(path, {key.rsplit("/", 1)[1] for key in wanted})
    for key, boxes in wanted.items():
        name, kind = key.removeprefix("optim/").rsplit("/", 1)
        model_key, index, part = plan[f"model/{name}"]
        full = reader.read(kind, model_key, index)
        if full is None:
            continue  # the master starts from the weights, as Megatron-LM's fp32 runs have it
        _fill(split_part(full, part, cfg).contiguous(), key, boxes, path)
    for piece in optimizer.pieces:
        entry = optimizer.optimizer.state.get(piece.master, {})
        if torch.is_tensor(entry.get("step")):
            entry["step"].fill_(float(reader.step))
    return reader.step
