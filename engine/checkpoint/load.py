"""Loading a checkpoint into any layout: check its files, its metadata and its shapes, then
read this rank's boxes through torch.distributed.checkpoint.

Every failure is one CheckpointError: a damaged or missing file (named), a checkpoint of
another model (the first mismatching tensor and both shapes), or a read that fails. In a
distributed job all ranks raise the same error (`every_rank`), so it is printed once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from engine.checkpoint.files import check_files, read_meta
from engine.checkpoint.state import (
    fp8_state,
    model_state,
    optimizer_state,
    prime_optimizer_state,
    rng_state,
    set_rng_state,
    weight_masters,
)
from engine.errors import CheckpointError, UserError
from engine.ops.fp8.apply import delayed_states
from parallel.checkpoint.dcp import BoxLoadPlanner, BoxTensor, SafeFileSystemReader
from parallel.consensus import first_error, gather_to_all, is_distributed
from parallel.errors import describe_os_error, one_line, root_cause


def _raise_agreed(problem: str | None, group) -> None:
    """Collective: the first rank's problem, if any rank has one, raised on every rank."""
    problem = first_error(problem, group)
    if problem:
        raise CheckpointError(problem, every_rank=is_distributed(group))


def verify_checkpoint(path: str, group=None, digests: bool = True) -> dict:
    """meta.json of the checkpoint folder `path`, once its files are known to be whole: every
    file present with the size it was written with and (when `digests`) the same checksum.
    Collective over `group`: the ranks share the reading, and all raise the same
    CheckpointError naming the first damaged file."""
    part = (0, 1)
    if is_distributed(group):
        part = (dist.get_rank(group), dist.get_world_size(group))
    meta, problem = None, None
    try:  # every rank reaches the agreement below, whatever it met
        meta = read_meta(path)
        problem = check_files(path, meta, digests, part) or None
    except CheckpointError as err:
        problem = str(err)
    except OSError as err:
        problem = describe_os_error(err, path)
    _raise_agreed(problem, group)
    meta["verified"] = digests and "files" in meta
    return meta


def check_shapes(
    path: str, stored_metadata, state: dict, group=None, strictness: str = "raise_all"
) -> tuple[list[str], list[str]]:
    """CheckpointError naming the first tensor whose stored shape differs from this model's,
    or that only one of them has where `strictness` (megatron-core's StrictHandling values,
    --dist-ckpt-strictness) says to stop. Returns the model's tensors the checkpoint lacks
    (to keep their initial values) and the checkpoint's the model lacks. `state` holds this
    rank's part of the model; the names of every rank's tensors are gathered over `group` to
    see the whole model."""
    stored = {
        k: v for k, v in stored_metadata.state_dict_metadata.items() if k.startswith("model/")
    }
    whole: dict = {}
    for part in gather_to_all(
        {k: tuple(v.global_shape) for k, v in state.items() if k.startswith("model/")}, group
    ):
        whole.update(part)
    every_rank = is_distributed(group)
    absent, extra = [], []
    for key in sorted(set(stored) | set(whole)):
        name = key[len("model/") :]
        if key not in stored:
            if strictness.startswith(("log_", "ignore_")):
                absent.append(name)
                continue
            raise CheckpointError(
                f"{path} was saved from a different model: it has no tensor {name}, which "
                "this model needs (--dist-ckpt-strictness log_unexpected keeps its initial "
                "value)",
                every_rank=every_rank,
            )
        if key not in whole:
            if strictness != "raise_all":
                extra.append(name)
                continue
            raise CheckpointError(
                f"{path} was saved from a different model: its tensor {name} does not exist "
                "in this model (--dist-ckpt-strictness raise_all)",
                every_rank=every_rank,
            )
        if tuple(stored[key].size) != whole[key]:
            raise CheckpointError(
                f"{path} was saved from a different model: tensor {name} has shape "
                f"{list(stored[key].size)} there and {list(whole[key])} here; give the model "
                "flags it was trained with (or --use-checkpoint-args)",
                every_rank=every_rank,
            )
    return absent, extra


def open_checkpoint(path: str, group=None) -> SafeFileSystemReader:
    """A reader of the checkpoint `path` whose metadata has been read (and checked): every rank
    raises the same CheckpointError when any cannot read it."""
    reader = SafeFileSystemReader(path)
    problem = None
    try:
        reader.read_metadata()
    except CheckpointError as err:
        problem = str(err)
    _raise_agreed(problem, group)
    return reader


def read_tensors(path: str, state: dict, group=None, reader=None, local: bool = False) -> None:
    """dcp.load of `state` (boxes and tensors, filled in place) from the checkpoint `path`,
    any failure as one CheckpointError (DCP reports a failure on every rank). `reader`: from
    open_checkpoint, to parse the metadata once for several reads. `local`: this rank alone
    reads (no collective; the ranks may read different tensors)."""
    import warnings

    distributed = is_distributed(group) and not local
    reader = reader or open_checkpoint(path, group)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # single process without torch.distributed: fine
            dcp.load(
                state,
                planner=BoxLoadPlanner(),
                storage_reader=reader,
                process_group=group,
                no_dist=not distributed,
            )
    except (CheckpointException, Exception) as err:  # noqa: BLE001 - reported as one line
        cause = root_cause(err)
        if isinstance(cause, UserError):
            raise CheckpointError(str(cause), every_rank=distributed) from None
        raise CheckpointError(
            f"{path}: reading the checkpoint failed ({one_line(cause)}); it is "
            "damaged: load an earlier checkpoint (loading without --no-verify names the file)",
            every_rank=distributed,
        ) from None


def _fp8_to_load(fp8: dict, stored: dict, path: str) -> dict:
    """The FP8 delayed-scaling states the checkpoint holds (a run without them starts its
    scales afresh); one of another history length is refused in one line."""
    out = {}
    for key, wanted in fp8.items():
        if key not in stored:
            continue
        if tuple(stored[key].size) != tuple(wanted.size()):
            raise CheckpointError(
                f"{path}: {key} has shape {list(stored[key].size)}, this run "
                f"{list(wanted.size())}; give the checkpoint's --fp8-amax-history-len"
            )
        out[key] = wanted
    return out


def load_checkpoint(
    path: str,
    chunks,
    optimizer,
    rank: int,
    layout: dict,
    tracker,
    group=None,
    load_optimizer: bool = True,
    verify: bool = True,
    load_rng: bool = True,
    strictness: str = "assume_ok_unexpected",
) -> dict:
    """Load the checkpoint at `path` into this rank's model and optimizer, for any layout,
    after checking its files (checksums too unless `verify` is False). Returns meta.json.
    RNG states are restored only when `layout` equals the saved one (and `load_rng`). Without
    `load_optimizer` the optimizer starts afresh from the loaded weights. `strictness`:
    --dist-ckpt-strictness (check_shapes); meta["mismatch"] lists the model's tensors the
    checkpoint lacks ("unexpected", left as they were) and the checkpoint's the model lacks
    ("missing", not read), under megatron-core's names for them."""
    meta = verify_checkpoint(path, group, digests=verify)
    reader = open_checkpoint(path, group)
    available = reader.read_metadata()
    state = model_state(chunks, for_save=False)
    absent, extra = check_shapes(path, available, state, group, strictness)
    for name in absent:
        state.pop(f"model/{name}", None)
    stored = set(available.state_dict_metadata)
    state.update(_fp8_to_load(fp8_state(chunks), available.state_dict_metadata, path))
    if load_optimizer:
        prime_optimizer_state(optimizer)
        state.update(
            {k: v for k, v in optimizer_state(optimizer, chunks, False).items() if k in stored}
        )
    rng = {}
    if load_rng and meta.get("layout") == layout:
        wanted = {k: torch.empty_like(v) for k, v in rng_state(rank, tracker).items()}
        if set(wanted) <= stored:  # a converted checkpoint has none
            rng = wanted
            state.update(rng)
    # without the optimizer's state: the weights of a run with --fp8-param-gather from its
    # masters (with it, the masters are read and published into the weights)
    masters = {} if load_optimizer else _masters_for_weights(state, stored, meta)
    separate = [piece for piece in optimizer.pieces if piece.master is not piece.data]
    for piece in separate if load_optimizer else ():
        piece.master.fill_(float("nan"))  # (which masters the checkpoint held: see below)
    _read_with_masters(path, state, masters, group, reader)
    if load_optimizer:  # masters that are the weights themselves: the checkpoint's master
        # where it holds one apart (a run with --fp8-param-gather, whose weights are FP8)
        aliased = {k: v for k, v in weight_masters(optimizer, chunks).items() if k in stored}
        if aliased:
            read_tensors(path, aliased, group, reader)
    for delayed in delayed_states(chunks):
        delayed.seen = None  # which roles have an amax: read again from the loaded history
    for piece in optimizer.pieces:
        if load_optimizer:
            entry = optimizer.optimizer.state.get(piece.master, {})
            if "step" in entry and torch.is_tensor(entry["step"]):
                entry["step"].fill_(float(meta.get("optimizer_step", 0)))
    for piece in separate:  # no master read for it: start from the weights
        if not load_optimizer or torch.isnan(piece.master).any():
            piece.master.copy_(piece.data)
    if rng:
        prefix = f"rng/rank{rank}/"
        set_rng_state({k[len(prefix) :]: v for k, v in rng.items()}, tracker)
    meta["rng_restored"] = bool(rng)
    meta["mismatch"] = {"unexpected": absent, "missing": extra}
    return meta


def master_key(key: str) -> str:
    """The optimizer's fp32 master of the checkpoint's model/ key `key` (same boxes)."""
    return f"optim/{key.removeprefix('model/')}/master"


def _masters_for_weights(state: dict, stored, meta: dict) -> dict:
    """For a checkpoint of a run with --fp8-param-gather (its model/ weights hold FP8 values,
    its masters what the optimizer trained): the model/ entries of `state` that have a master,
    moved out of `state` and re-keyed to it, each box read into an fp32 copy;
    `_read_with_masters` reads them and writes them into the weights."""
    if not meta.get("fp8_param_gather"):
        return {}
    out = {}
    for key in [k for k in state if k.startswith("model/") and master_key(k) in stored]:
        entry = state.pop(key)
        boxes = [(offset, tensor.float().clone(), tensor) for offset, tensor in entry.boxes]
        copy = BoxTensor(entry.global_shape, torch.float32, [b[:2] for b in boxes])
        out[master_key(key)] = (copy, boxes)
    return out


def _read_with_masters(path: str, state: dict, masters: dict, group, reader) -> None:
    """`state`'s tensors, and the masters of _masters_for_weights into their weights."""
    read_tensors(path, state | {key: copy for key, (copy, _) in masters.items()}, group, reader)
    for _, boxes in masters.values():
        for _, master, weight in boxes:
            weight.copy_(master)


def load_model_weights(path: str, model, verify: bool = True) -> dict:
    """Load only the model tensors of the checkpoint at `path` into a GPTModel of any layout
    (one process, no optimizer) after checking its files; returns meta.json."""

    class _Chunk:
        module = model

    meta = verify_checkpoint(path, digests=verify)
    reader = open_checkpoint(path)
    state = model_state([_Chunk()], for_save=False)
    metadata = reader.read_metadata()
    check_shapes(path, metadata, state)
    masters = _masters_for_weights(state, metadata.state_dict_metadata, meta)
    _read_with_masters(path, state, masters, None, reader)
    return meta
