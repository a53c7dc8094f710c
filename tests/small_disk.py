"""A real full disk for the tests: run a command in its own mount namespace with a small tmpfs
mounted at a folder, so that writes past its size fail with ENOSPC exactly as on a full disk.
Needs `unshare` and user (or root) mount namespaces; tests skip where that is not available.
Everything written on the tmpfs vanishes with the namespace, so a scenario runs inside it
whole and reports what it saw on stdout.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

_MOUNT_THEN_RUN = 'mount -t tmpfs -o size="$1" tmpfs "$0" && shift && exec "$@"'


def small_disk_command(mountpoint: str, size: str, argv: list[str]) -> list[str]:
    """argv, run with a tmpfs of `size` (e.g. '256k'; '64k,ro' mounts it read-only) mounted at
    `mountpoint`."""
    return [
        "unshare",
        "--mount",
        "--map-root-user",
        "sh",
        "-c",
        _MOUNT_THEN_RUN,
        mountpoint,
        size,
        *argv,
    ]


@functools.lru_cache(maxsize=1)
def small_disk_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(
            small_disk_command("/tmp", "64k", ["true"]), capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def run_on_small_disk(mountpoint, size: str, argv: list[str], timeout: float = 240):
    """argv (`python` and its arguments, from the repository root, this checkout's code, one
    thread per process) with a tmpfs of `size` at `mountpoint`; the CompletedProcess."""
    from tests.cli import ENV, ROOT

    return subprocess.run(
        small_disk_command(str(mountpoint), size, argv),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**ENV, "OMP_NUM_THREADS": "1"},
    )
