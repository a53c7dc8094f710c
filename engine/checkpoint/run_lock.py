"""One run per --save folder: the run's first rank holds an exclusive lock on
`<save>/.run.lock` while it lives, so that a second run writing the same folder is refused
at its start (one line naming the holder) instead of deleting the first run's live
`iter_N.tmp` or replacing its checkpoints.

The lock is a POSIX record lock (`fcntl.lockf`) on the file: it belongs to the process alone
(data-loader workers forked from it do not share it, so none outlives a killed rank), the
kernel releases it when the process ends however it ends, and NFS honours it (Lustre with its
`flock` mount option). The file's text says who holds it (host, pid, start time) for the message.
A process must not open and close the file while it holds the lock (that releases it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time

from engine.errors import CheckpointError

LOCK_FILE = ".run.lock"


def _open(folder: str):
    os.makedirs(folder, exist_ok=True)
    return open(os.path.join(folder, LOCK_FILE), "a+")  # noqa: SIM115 - held for the run


def _holder(lock_file) -> str:
    lock_file.seek(0)
    text = lock_file.read().strip()
    return f"the run {text}" if text else "another run"


def _try_lock(lock_file, folder: str, mode: int) -> None:
    try:
        fcntl.lockf(lock_file.fileno(), mode | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        holder = _holder(lock_file)
        lock_file.close()
        raise CheckpointError(
            f"--save {folder} is in use by {holder}; stop that run or give another --save"
        ) from None


def check_free(folder: str) -> None:
    """CheckpointError (one line) when a live run holds `folder`; takes nothing (a shared lock
    for a moment, so that the ranks of one run can all check at once)."""
    lock_file = _open(folder)
    _try_lock(lock_file, folder, fcntl.LOCK_SH)
    lock_file.close()  # closing releases the lock


def hold(folder: str, patience_s: float = 5.0):
    """Take the lock for this process's lifetime (CheckpointError when a live run holds it);
    returns the open file, which keeps it. A lock held for a moment (another process's
    check_free) is waited for up to `patience_s`."""
    deadline = time.monotonic() + patience_s
    while True:
        lock_file = _open(folder)
        try:
            _try_lock(lock_file, folder, fcntl.LOCK_EX)
            break
        except CheckpointError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    lock_file.seek(0)
    lock_file.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    lock_file.write(f"of pid {os.getpid()} on {socket.gethostname()} since {started}")
    lock_file.flush()
    return lock_file
