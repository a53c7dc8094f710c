"""Sharded checkpoints through torch.distributed.checkpoint: save, atomic commit, resume,
resharding.

Layout, as in Megatron-LM:

    <save>/iter_0000100/              DCP files (every rank writes its own) + meta.json
    <save>/latest_checkpointed_iteration.txt

Every tensor is stored as its *logical global* tensor (a fused QKV as .q/.k/.v, vocabulary
padding cut off) and each rank writes the boxes of it that it owns, so a checkpoint saved
under one (TP, PP, DP, distributed optimizer on/off) layout loads under any other: model,
fp32 master weights and optimizer moments alike. meta.json holds the rest as JSON: iteration,
consumed samples, layout, model config, scheduler, loss scaler, counters. Per-rank RNG states
(python, numpy, torch, CUDA, the TP tracker) are tensors in the checkpoint and are restored
when the layout is unchanged (exact resume); under a new layout the streams are re-seeded.

Atomic: ranks write into iter_N.tmp; once every rank is done, rank 0 adds meta.json, renames
the folder into place and only then replaces the latest file (itself via a rename). A crash at
any point leaves the previous checkpoint as the latest. --async-save copies the state to host
memory and writes it from a background thread over a separate process group; the copy overlaps
the next forward and backward, and the next optimizer update waits for it (wait_for_copy).
Loading unpickles nothing arbitrary (see parallel/dcp.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from engine import faults
from engine.errors import CheckpointError
from parallel.dcp import BoxLoadPlanner, BoxSavePlanner, BoxTensor, SafeFileSystemReader
from parallel.sharding import checkpoint_boxes, tp_sharding_of

FORMAT_VERSION = 1
LATEST = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def find_latest(root: str | None) -> int | None:
    """The newest committed iteration under root, or None when there is none."""
    if not root:
        return None
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None
    if not os.path.isfile(os.path.join(iteration_dir(root, iteration), "meta.json")):
        raise CheckpointError(
            f"{path} names iteration {iteration}, but {iteration_dir(root, iteration)} is not a "
            "complete checkpoint"
        )
    return iteration


# --- what goes into a checkpoint --------------------------------------------------------


def _param_names(chunks) -> dict:
    names = {}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            names[param] = getattr(param, "checkpoint_name", name)
    return names


def _add_boxes(out: dict, key: str, box, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    entry = out.get(key)
    if entry is None:
        entry = out[key] = BoxTensor(torch.Size(box.global_shape), dtype, [])
    entry.boxes.append((box.global_offset, tensor))


def model_state(chunks, for_save: bool) -> dict[str, BoxTensor]:
    """'model/<name><part>' -> boxes of every parameter this rank holds. Saving skips the last
    stage's copy of a tied embedding (the first stage writes the same tensor)."""
    out: dict[str, BoxTensor] = {}
    for param, name in _param_names(chunks).items():
        if for_save and getattr(param, "shared_embedding", False):
            continue
        flat = param.data.reshape(-1)
        for box in checkpoint_boxes(
            param.shape, tp_sharding_of(param), real_rows=getattr(param, "real_rows", None)
        ):
            view = flat[box.flat_start : box.flat_end].view(box.sizes)
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
                    out,
                    f"optim/{names[param]}{box.suffix}/{kind}",
                    box,
                    view.view(box.sizes),
                    flat.dtype,
                )
    return out


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


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    pin = like.device.type == "cuda"
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)


def _staging_buffers(state: dict) -> dict:
    """Host tensors shaped like every tensor of the state, touched once so that copying into
    them later costs no page faults."""
    out = {}
    for key, value in state.items():
        if isinstance(value, BoxTensor):
            boxes = [(o, _host_buffer(t).zero_()) for o, t in value.boxes]
            out[key] = BoxTensor(value.global_shape, value.dtype, boxes)
        else:
            out[key] = _host_buffer(value).zero_()
    return out


def _copy_into(staging: dict, state: dict) -> dict:
    """Copy the state into the staging buffers (what an async save writes while training goes
    on); returns the staging dict."""
    for key, value in state.items():
        target = staging[key]
        if isinstance(value, BoxTensor):
            for (_, dst), (_, src) in zip(target.boxes, value.boxes):
                dst.copy_(src, non_blocking=True)
        else:
            target.copy_(value, non_blocking=True)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return staging


def _same_layout(staging: dict | None, state: dict) -> bool:
    if staging is None or staging.keys() != state.keys():
        return False
    for key, value in state.items():
        target = staging[key]
        if isinstance(value, BoxTensor):
            if [t.shape for _, t in target.boxes] != [t.shape for _, t in value.boxes]:
                return False
        elif target.shape != value.shape:
            return False
    return True


# --- saving -------------------------------------------------------------------------------


class Checkpointer:
    """Saves checkpoints under `root`; at most one is being written at a time."""

    def __init__(
        self, root: str, group, rank: int, async_save: bool = False, keep_last_n: int | None = None
    ):
        self.root, self.group, self.rank = root, group, rank
        self.async_save, self.keep_last_n = async_save, keep_last_n
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: dict | None = None  # host buffers reused by every async save
        self._staged = threading.Event()  # set once the pending async save has its copy
        self._staged.set()
        self.copy_wait_s = 0.0

    def _state(self, chunks, optimizer, tracker) -> dict:
        """Views of the live model and optimizer state, plus copies of the RNG states."""
        state = model_state(chunks, for_save=True)
        state.update(optimizer_state(optimizer, chunks, for_save=True))
        state.update(rng_state(self.rank, tracker))
        return state

    def prepare(self, chunks, optimizer, tracker) -> None:
        """Allocate the async-save staging buffers now, outside the training loop."""
        if self.async_save:
            prime_optimizer_state(optimizer)
            self._staging = _staging_buffers(self._state(chunks, optimizer, tracker))

    def save(self, iteration: int, chunks, optimizer, meta: dict, tracker) -> float:
        """Write the checkpoint of `iteration`; returns the seconds the caller was stalled."""
        import time

        start = time.perf_counter()
        self.wait()
        tmp = iteration_dir(self.root, iteration) + ".tmp"
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):
                if name.endswith(".tmp"):  # a save that never committed
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        dist.barrier(group=self.group)
        optimizer.finish_param_sync()
        state = self._state(chunks, optimizer, tracker)
        meta = dict(meta, format_version=FORMAT_VERSION, iteration=iteration)
        if self.async_save:
            if not _same_layout(self._staging, state):
                self._staging = _staging_buffers(state)
            self._staged.clear()
            self._thread = threading.Thread(
                target=self._copy_and_write, args=(state, tmp, iteration, meta), daemon=True
            )
            self._thread.start()
        else:
            self._write(state, tmp, iteration, meta)
            self._raise_pending()
        return time.perf_counter() - start

    def _copy_and_write(self, state, tmp: str, iteration: int, meta: dict) -> None:
        """Background: copy the live state to host buffers, let training update it again, then
        write. Nothing changes the saved tensors until the next optimizer update, which waits
        for the copy (wait_for_copy), so the copy overlaps the next forward and backward."""
        try:
            staged = _copy_into(self._staging, state)
        except BaseException as err:  # noqa: BLE001 - surfaced by wait()
            self._error = err
            return
        finally:
            self._staged.set()
        self._write(staged, tmp, iteration, meta)

    def wait_for_copy(self) -> None:
        """Before the model or optimizer state changes: block until a pending async save has
        copied it (usually long done: the copy overlaps forward and backward). The time spent
        blocked is kept in `copy_wait_s`."""
        import time

        start = time.perf_counter()
        self._staged.wait()
        self.copy_wait_s = time.perf_counter() - start

    def _write(self, state, tmp: str, iteration: int, meta: dict) -> None:
        try:
            dcp.save(
                state,
                storage_writer=faults.storage_writer(tmp, self.rank, iteration),
                planner=BoxSavePlanner(),
                process_group=self.group,
            )
            if self.rank == 0:  # dcp.save returns on rank 0 only after every rank has written
                self._commit(tmp, iteration, meta)
        except BaseException as err:  # noqa: BLE001 - surfaced by wait()
            self._error = err

    def _commit(self, tmp: str, iteration: int, meta: dict) -> None:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, self.root, iteration)
        if self.keep_last_n:
            committed = sorted(
                int(n[len("iter_") :])
                for n in os.listdir(self.root)
                if n.startswith("iter_") and n[len("iter_") :].isdigit()
            )
            for old_iteration in committed[: -self.keep_last_n]:
                shutil.rmtree(iteration_dir(self.root, old_iteration), ignore_errors=True)

    def wait(self) -> None:
        """Block until a background save has finished (and re-raise its error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(
                f"saving a checkpoint under {self.root} failed: {error}"
            ) from error


def commit(tmp: str, root: str, iteration: int) -> None:
    """Rename a fully written iteration folder into place, then point the latest file at it
    (itself written under a temporary name and renamed)."""
    final = iteration_dir(root, iteration)
    if os.path.exists(final):
        old = final + ".old"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    latest_tmp = os.path.join(root, LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, LATEST))


# --- loading ------------------------------------------------------------------------------


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no meta.json; not a complete checkpoint") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{meta_path}: corrupt ({err})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format_version')}, this engine reads "
            f"{FORMAT_VERSION}"
        )
    return meta


def check_shapes(path: str, state: dict, group=None) -> None:
    """CheckpointError naming the first tensor whose stored shape differs from this model's,
    or that only one of them has. `state` holds this rank's part of the model; the names of
    every rank's tensors are gathered over `group` to see the whole model."""
    metadata = SafeFileSystemReader(path).read_metadata()
    stored = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model/")}
    ours = {k: tuple(v.global_shape) for k, v in state.items() if k.startswith("model/")}
    whole = dict(ours)
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, ours, group=group)
        for part in gathered:
            whole.update(part)
    for key in sorted(set(stored) | set(whole)):
        name = key[len("model/") :]
        if key not in stored:
            raise CheckpointError(
                f"{path} was saved from a different model: it has no tensor {name}, which "
                "this model needs"
            )
        if key not in whole:
            raise CheckpointError(
                f"{path} was saved from a different model: its tensor {name} does not exist "
                "in this model"
            )
        if tuple(stored[key].size) != whole[key]:
            raise CheckpointError(
                f"{path} was saved from a different model: tensor {name} has shape "
                f"{list(stored[key].size)} there and {list(whole[key])} here"
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
    for group, (lr, decay) in zip(optimizer.optimizer.param_groups, saved):
        group["lr"], group["weight_decay"] = lr, decay


def load_checkpoint(
    path: str,
    chunks,
    optimizer,
    rank: int,
    layout: dict,
    tracker,
    group=None,
    load_optimizer: bool = True,
) -> dict:
    """Load the checkpoint at `path` into this rank's model and optimizer, for any layout.
    Returns meta.json. RNG states are restored only when `layout` equals the saved one."""
    meta = read_meta(path)
    state = model_state(chunks, for_save=False)
    check_shapes(path, state, group)
    if load_optimizer:
        prime_optimizer_state(optimizer)
        available = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
        state.update(
            {k: v for k, v in optimizer_state(optimizer, chunks, False).items() if k in available}
        )
    rng = {}
    if meta.get("layout") == layout:
        available = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
        wanted = {k: torch.empty_like(v) for k, v in rng_state(rank, tracker).items()}
        if set(wanted) <= available:  # a converted checkpoint has none
            rng = wanted
            state.update(rng)
    dcp.load(
        state,
        checkpoint_id=path,
        planner=BoxLoadPlanner(),
        storage_reader=SafeFileSystemReader(path),
        process_group=group,
    )
    if load_optimizer:
        for piece in optimizer.pieces:
            entry = optimizer.optimizer.state.get(piece.master, {})
            if "step" in entry and torch.is_tensor(entry["step"]):
                entry["step"].fill_(float(meta.get("optimizer_step", 0)))
            if piece.master is not piece.data and not any(k.endswith("/master") for k in state):
                piece.master.copy_(piece.data)  # no master weights saved: start from params
    if rng:
        prefix = f"rng/rank{rank}/"
        set_rng_state({k[len(prefix) :]: v for k, v in rng.items()}, tracker)
    meta["rng_restored"] = bool(rng)
    return meta


def load_model_weights(path: str, model) -> dict:
    """Load only the model tensors of the checkpoint at `path` into a GPTModel of any layout
    (one process, no optimizer); returns meta.json."""
    import warnings

    class _Chunk:
        module = model

    meta = read_meta(path)
    state = model_state([_Chunk()], for_save=False)
    check_shapes(path, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single process without torch.distributed: fine
        dcp.load(
            state,
            planner=BoxLoadPlanner(),
            storage_reader=SafeFileSystemReader(path),
            no_dist=not dist.is_initialized(),
        )
    return meta
