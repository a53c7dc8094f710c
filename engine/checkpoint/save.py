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
Loading unpickles nothing arbitrary (see parallel/checkpoint/dcp.py), and first checks the files
against the sizes and checksums recorded when they were written (see engine/checkpoint/files.py).
"""

from __future__ import annotations

import os
import shutil
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from engine.checkpoint import faults, run_lock
from engine.checkpoint.files import (
    commit,
    committed_iterations,
    find_latest,
    iteration_dir,
    write_meta,
)
from engine.checkpoint.staging import HostStaging
from engine.checkpoint.state import (
    fp8_state,
    model_state,
    optimizer_state,
    prime_optimizer_state,
    rng_state,
)
from engine.errors import CheckpointError, UserError
from parallel.checkpoint.dcp import BoxSavePlanner
from parallel.consensus import first_error, gather_to_all
from parallel.errors import describe_os_error, one_line, root_cause

# --- saving ---------------------------------------------------------------------------


class Checkpointer:
    """Saves checkpoints under `root`; at most one is being written at a time."""

    def __init__(
        self,
        root: str,
        group,
        rank: int,
        async_save: bool = False,
        keep_last_n: int | None = None,
        device: torch.device | None = None,
        retain_interval: int | None = None,
    ):
        self.root, self.group, self.rank = root, group, rank
        self.device = device if device is not None else torch.device("cpu")  # the rank's
        self.async_save, self.keep_last_n = async_save, keep_last_n
        self.retain_interval = retain_interval
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: HostStaging | None = None  # reused by every async save
        self._staged = threading.Event()  # set once the pending async save has its copy
        self._staged.set()
        self.copy_wait_s = 0.0
        self._lock = None  # rank 0 holds the folder for the run (engine/checkpoint/run_lock.py)
        problem = None
        if rank == 0:
            try:
                self._lock = run_lock.hold(root)
            except CheckpointError as err:
                problem = str(err)
        problem = first_error(problem, group)
        if problem:
            raise CheckpointError(problem, every_rank=group is not None)

    def release(self) -> None:
        """Give the --save folder back (at the end of the run; the process's end does too)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _state(self, chunks, optimizer, tracker) -> dict:
        """Views of the live model and optimizer state, plus copies of the RNG states."""
        state = model_state(chunks, for_save=True)
        state.update(fp8_state(chunks))
        state.update(optimizer_state(optimizer, chunks, for_save=True))
        state.update(rng_state(self.rank, tracker))
        return state

    def prepare(self, chunks, optimizer, tracker) -> None:
        """Allocate the async-save staging buffers now, outside the training loop."""
        if self.async_save:
            prime_optimizer_state(optimizer)
            self._staging = HostStaging(self._state(chunks, optimizer, tracker), self.device)

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
        meta = dict(meta, iteration=iteration)
        if self.async_save:
            if self._staging is None or not self._staging.matches(state):
                self._staging = HostStaging(state, self.device)
            ready = self._staging.mark_ready()
            self._staged.clear()
            self._thread = threading.Thread(
                target=self._copy_and_write,
                args=(state, ready, tmp, iteration, meta),
                daemon=True,
            )
            self._thread.start()
        else:
            self._write(state, tmp, iteration, meta)
            self._raise_pending()
        return time.perf_counter() - start

    def _copy_and_write(self, state, ready, tmp: str, iteration: int, meta: dict) -> None:
        """Background: copy the live state to host buffers, let training update it again, then
        write. Nothing changes the saved tensors until the next optimizer update, which waits
        for the copy (wait_for_copy), so the copy overlaps the next forward and backward. A
        failed copy still takes part in the ranks' agreement, so no peer waits for it."""
        staged, failed = None, None
        try:
            staged = self._staging.copy_from(state, ready)
        except BaseException as err:  # noqa: BLE001 - agreed on and surfaced by wait()
            failed = self._failure(err, iteration)
        finally:
            self._staged.set()
        self._write(staged, tmp, iteration, meta, failed)

    def wait_for_copy(self) -> None:
        """Before the model or optimizer state changes: block until a pending async save has
        copied it (usually long done: the copy overlaps forward and backward). The time spent
        blocked is kept in `copy_wait_s`."""
        import time

        start = time.perf_counter()
        self._staged.wait()
        self.copy_wait_s = time.perf_counter() - start

    def _write(self, state, tmp: str, iteration: int, meta: dict, failed: str | None = None):
        """Every rank writes its part and records its files' checksums; rank 0 commits. The
        ranks agree before writing (an async copy may have failed) and after, so a failure
        anywhere (a full disk, say) stops every rank with the same message, and the
        unfinished folder is removed. Whatever happens is kept in `_error` for wait()."""
        try:
            error = self._write_agreed(state, tmp, iteration, meta, failed)
        except BaseException as err:  # noqa: BLE001 - a collective itself failed (a peer died)
            error = self._failure(err, iteration)
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._error = CheckpointError(error, every_rank=self.group is not None)

    def _write_agreed(self, state, tmp, iteration, meta, failed) -> str | None:
        """The save's collective steps; the error every rank agreed on, or None."""
        error = first_error(failed, self.group)
        if error is not None:
            return error
        files, writer, own_os_error = {}, None, False
        try:
            writer = faults.storage_writer(tmp, self.rank, iteration)
            dcp.save(
                state, storage_writer=writer, planner=BoxSavePlanner(), process_group=self.group
            )
            files = writer.files
        except BaseException as err:  # noqa: BLE001 - agreed on below
            own_os_error = bool(writer is not None and writer.errors)
            error = self._failure(writer.errors[0] if own_os_error else err, iteration)
        outcomes = gather_to_all((files, error, own_os_error), self.group)
        # A rank whose own write failed knows the cause; the others only see DCP's report.
        errors = [e for _, e, own in outcomes if e and own] + [e for _, e, _ in outcomes if e]
        if errors:
            return errors[0]
        if self.rank == 0:
            try:
                write_meta(
                    tmp, dict(meta, files={k: v for p, _, _ in outcomes for k, v in p.items()})
                )
                commit(tmp, self.root, iteration)
            except Exception as err:  # noqa: BLE001 - agreed on below
                error = self._failure(err, iteration)
            else:
                self._prune()
        return first_error(error, self.group)

    def _failure(self, err: BaseException, iteration: int) -> str:
        """One line for a failed save: the cause (a full disk named as such) and what stays."""
        cause = root_cause(err)
        if isinstance(cause, OSError):
            what = describe_os_error(cause, cause.filename or self.root)
        else:
            what = one_line(cause)
        try:
            previous = find_latest(self.root)
        except (CheckpointError, OSError):
            previous = None
        kept = (
            f"iteration {previous} stays the latest checkpoint"
            if previous is not None
            else "no earlier checkpoint exists"
        )
        return (
            f"saving the checkpoint of iteration {iteration} under {self.root} failed: {what}; "
            + kept
        )

    def _prune(self) -> None:
        """--keep-last-n: remove the oldest committed checkpoints; --save-retain-interval
        (Megatron-LM's meaning): remove every one but the newest whose iteration is not a
        multiple of it. Best effort (one left behind is removed by a later save). Only ours:
        folders of another writer in the same place (Megatron-LM's, when --save is the --load
        it resumed from) are left alone."""
        if not (self.keep_last_n or self.retain_interval):
            return
        try:
            committed = committed_iterations(self.root)
        except OSError:
            return
        doomed = set(committed[: -self.keep_last_n]) if self.keep_last_n else set()
        if self.retain_interval:
            doomed |= {i for i in committed[:-1] if i % self.retain_interval}
        for old_iteration in sorted(doomed):
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
            if isinstance(error, UserError):
                raise error
            raise CheckpointError(
                f"saving a checkpoint under {self.root} failed: {error}"
            ) from error
