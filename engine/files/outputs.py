"""Places a tool or a run will write to, checked before the work starts."""

from __future__ import annotations

import os
import shutil
import tempfile


def probe_writable_folder(folder: str | os.PathLike) -> None:
    """Create `folder` if needed and a file in it, then remove the file: OSError (a file in
    the way, no permission, a read-only or full disk) when either cannot be done."""
    os.makedirs(folder, exist_ok=True)
    handle, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")
    os.close(handle)
    os.remove(probe)


def replace_folder(tmp: str, output: str) -> None:
    """Put the finished folder `tmp` at `output`, moving any earlier one aside first and
    removing it only once the new one is in place."""
    if os.path.exists(output):
        old = f"{output.rstrip('/')}.old.{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output, old)
        os.replace(tmp, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, output)
