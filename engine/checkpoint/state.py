"""What goes into a checkpoint: the boxes of every model parameter and optimizer state this
rank holds (as parallel.checkpoint.dcp.BoxTensor, keyed by the parameter's logical global name), and
each rank's random states as plain tensors."""

from __future__ import annotations

import random

import numpy as np
import torch

from parallel.checkpoint.boxes import checkpoint_boxes
from parallel.checkpoint.dcp import BoxTensor
from parallel.tensor_parallel.sharding import tp_sharding_of


def _param_names(chunks) -> dict:
    names = {}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            names[param] = getattr(param, "checkpoint_name", name)
    return names


def _held(chunks) -> dict:
    """param -> [(offset, numel, flat values)] of what this rank holds of it: the whole
    parameter, or under sharded parameters the part in its DP shard."""
    held = {}
    for chunk in chunks:
        pieces = getattr(chunk, "held_pieces", None)
        for param in chunk.module.parameters():
            if pieces is not None and param in chunk.bucket_of:
                held[param] = pieces(param)
            else:
                held[param] = [(0, param.numel(), param.data.reshape(-1))]
    return held


def _add_boxes(out: dict, key: str, box, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    entry = out.get(key)
    if entry is None:
        entry = out[key] = BoxTensor(torch.Size(box.global_shape), dtype, [])
    entry.boxes.append((box.global_offset, tensor))


def model_state(chunks, for_save: bool) -> dict[str, BoxTensor]:
    """'model/<name><part>' -> boxes of every parameter this rank holds. Saving skips the last
    stage's copy of a tied embedding (the first stage writes the same tensor)."""
    out: dict[str, BoxTensor] = {}
    held = _held(chunks)
    for param, name in _param_names(chunks).items():
        if for_save and getattr(param, "shared_embedding", False):
            continue
        for offset, numel, flat in held[param]:
            for box in checkpoint_boxes(
                param.shape,
                tp_sharding_of(param),
                offset,
                offset + numel,
                getattr(param, "real_rows", None),
            ):
                view = flat[box.flat_start - offset : box.flat_end - offset].view(box.sizes)
                _add_boxes(out, f"model/{name}{box.suffix}", box, view, param.dtype)
    return out


def optimizer_state(optimizer, chunks, for_save: bool) -> dict[str, BoxTensor]:
    """'optim/<name><part>/<state>' -> boxes of the optimizer state of this rank's pieces
    (Adam moments, and the fp32 master when it is a copy of a bf16/fp16 parameter)."""
    names = _param_names(chunks)
    out: dict[str, BoxTensor] = {}
    for piece in optimizer.pieces:
        param = piece.param
        if for_save and getattr(param, "shared_embedding", False):
            continue
        tensors = {
            k: v
            for k, v in optimizer.optimizer.state.get(piece.master, {}).items()
            if k != "step" and torch.is_tensor(v) and v.numel() == piece.numel
        }
        if piece.master is not piece.data:
            tensors["master"] = piece.master
        _add_piece_boxes(out, piece, names[param], tensors)
    return out


def weight_masters(optimizer, chunks) -> dict[str, BoxTensor]:
    """'optim/<name><part>/master' -> boxes of the pieces whose master is the weight itself
    (fp32 weights), to read a checkpoint's master into the weight where the checkpoint keeps
    one apart (--fp8-param-gather's FP8 weights)."""
    names = _param_names(chunks)
    out: dict[str, BoxTensor] = {}
    for piece in optimizer.pieces:
        if piece.master is piece.data:
            _add_piece_boxes(out, piece, names[piece.param], {"master": piece.master})
    return out


def _add_piece_boxes(out: dict, piece, name: str, tensors: dict[str, torch.Tensor]) -> None:
    param = piece.param
    boxes = checkpoint_boxes(
        param.shape,
        tp_sharding_of(param),
        piece.offset,
        piece.offset + piece.numel,
        getattr(param, "real_rows", None),
    )
    for kind, flat in tensors.items():
        flat = flat.reshape(-1)
        for box in boxes:
            view = flat[box.flat_start - piece.offset : box.flat_end - piece.offset]
            _add_boxes(
                out, f"optim/{name}{box.suffix}/{kind}", box, view.view(box.sizes), flat.dtype
            )


def rng_state(rank: int, tracker) -> dict[str, torch.Tensor]:
    """This rank's random states as plain tensors, under rank-specific keys."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python_words": torch.tensor(words, dtype=torch.int64),
        "python_extra": torch.tensor(
            [version, gauss is not None, gauss or 0.0], dtype=torch.float64
        ),
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_extra": torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        for name, state in tracker.get_states().items():
            out[f"tracker_{name}"] = state
    return {f"rng/rank{rank}/{k}": v for k, v in out.items()}


def set_rng_state(states: dict[str, torch.Tensor], tracker) -> None:
    version, has_gauss, gauss = states["python_extra"].tolist()
    words = tuple(int(x) for x in states["python_words"].tolist())
    random.setstate((int(version), words, gauss if has_gauss else None))
    pos, np_has_gauss, cached = states["numpy_extra"].tolist()
    keys = states["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(pos), int(np_has_gauss), cached))
    torch.set_rng_state(states["torch_cpu"])
    if "torch_cuda" in states:
        torch.cuda.set_rng_state(states["torch_cuda"])
    if tracker is not None:
        tracker.set_states(
            {k[len("tracker_") :]: v for k, v in states.items() if k.startswith("tracker_")}
        )


def prime_optimizer_state(optimizer) -> None:
    """Create the inner optimizer's state (moments at zero) without changing any weight, so a
    checkpoint can be loaded into it: one step with learning rate 0 and no weight decay."""
    if optimizer.optimizer.state:
        return
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in optimizer.optimizer.param_groups]
    for group in optimizer.optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    for piece in optimizer.pieces:
        piece.master.grad = torch.zeros_like(piece.master)
    optimizer.optimizer.step()
    for piece in optimizer.pieces:
        piece.master.grad = None
        step = optimizer.optimizer.state.get(piece.master, {}).get("step")
        if torch.is_tensor(step):
            step.zero_()  # as if no step had been taken: the first real one counts as 1
    for group, (lr, decay) in zip(optimizer.optimizer.param_groups, saved, strict=False):
        group["lr"], group["weight_decay"] = lr, decay


def fp8_state(chunks) -> dict[str, BoxTensor]:
    """'fp8/<weight's name>/amax_history' and '/scale' of every FP8 linear under delayed
    scaling (engine/ops/fp8/delayed.py): the same on every TP, DP and CP rank (their amaxes are
    reduced), so each is one replicated box, loaded under any layout."""
    from engine.ops.fp8.apply import fp8_layers

    names = _param_names(chunks)
    out = {}
    for weight, fp8 in fp8_layers(chunks):
        if fp8.delayed is None:
            continue
        for key, tensor in (("amax_history", fp8.delayed.history), ("scale", fp8.delayed.scale)):
            shape = torch.Size(tensor.shape)
            out[f"fp8/{names[weight]}/{key}"] = BoxTensor(
                shape, tensor.dtype, [((0,) * len(shape), tensor)]
            )
    return out
