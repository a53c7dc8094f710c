"""Files of a curation task written whole or not at all, under names of their own per attempt:
a temporary file (host and process in its name) renamed over the target, so that two
attempts of one task running at once (a retry while a lost node still runs the first) never
write into each other's half-written files, and a reader sees the old file or the new one."""

from __future__ import annotations

import json
import os
import shutil
import socket

import numpy as np


def attempt() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def temporary(path: str, suffix: str = "") -> str:
    """A temporary name beside `path` for this attempt (`suffix` kept last: numpy appends
    .npy/.npz to a name without it)."""
    return f"{path}.tmp-{attempt()}{suffix}"


def save_npy(path: str, array) -> None:
    tmp = temporary(path, ".npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def save_npz(path: str, **arrays) -> None:
    tmp = temporary(path, ".npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def save_json(path: str, value) -> None:
    tmp = temporary(path)
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def remove_stale_folders(final: str) -> None:
    """Temporary folders of `final` left by attempts of this host whose process is gone."""
    folder, name = os.path.split(final)
    prefix = f"{name}.tmp-{socket.gethostname()}-"
    for entry in os.listdir(folder):
        if entry.startswith(prefix) and entry[len(prefix) :].isdigit():
            pid = int(entry[len(prefix) :])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
            except PermissionError:  # alive, another user's
                pass
