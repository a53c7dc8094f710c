"""Fault injection in a checkpoint's save, for the robustness tests. Inert unless set:

    TRIPOD_FAULT_KILL_IN_SAVE=1:8     rank 1 kills itself in the middle of the save of
                                      iteration 8: its data files are written, the checkpoint's
                                      metadata and commit are not (with --async-save: in the
                                      background commit)
    TRIPOD_FAULT_DISK_FULL_IN_SAVE=1:8  rank 1's writes of the save of iteration 8 fail as on a
                                      full disk (ENOSPC); tests/small_disk.py makes a real one

(The faults injected into training iterations are engine/train/faults.py's.) Every fault fires in
each attempt of a job that torchrun restarts, unless TRIPOD_FAULT_ATTEMPT=K limits them to the
attempt whose TORCHELASTIC_RESTART_COUNT is K (0: the first).
"""

from __future__ import annotations

import errno
import os
import signal

from parallel.checkpoint.checksums import ChecksummingWriter


def rank_at(name: str, rank: int, iteration: int) -> bool:
    """Whether the variable `name` is set to `rank:iteration` (in this attempt)."""
    return os.environ.get(name) == f"{rank}:{iteration}" and in_faulty_attempt()


def in_faulty_attempt() -> bool:
    """Whether faults fire in this attempt (TRIPOD_FAULT_ATTEMPT, all attempts when unset)."""
    wanted = os.environ.get("TRIPOD_FAULT_ATTEMPT")
    return wanted is None or wanted == os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def storage_writer(path: str, rank: int, iteration: int):
    """The DCP storage writer for a save (recording checksums), or one that dies mid-save."""
    if rank_at("TRIPOD_FAULT_DISK_FULL_IN_SAVE", rank, iteration):

        class _DiskFull(ChecksummingWriter):
            def write_data(self, plan, planner):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        return _DiskFull(path)
    if not rank_at("TRIPOD_FAULT_KILL_IN_SAVE", rank, iteration):
        return ChecksummingWriter(path)

    class _DiesAfterWriting(ChecksummingWriter):
        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            os.kill(os.getpid(), signal.SIGKILL)
            return future

    return _DiesAfterWriting(path)
