"""Running the project's command lines from the tests as a user would: this checkout's Python
code (whatever an editable install points at), from the repository root, output captured."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The CPU tests' processes leave a machine's GPUs alone (gloo ranks on a GPU host would each
# take, and collide on, GPU 0); the GPU-marked tests run in the test process itself.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
ENV = {
    **os.environ,
    **CPU_ONLY,
    "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
}


def run_python(*args: str, timeout: float = 300, env: dict | None = None):
    """`python ARGS...` from the repository root; the CompletedProcess, text captured."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**ENV, **(env or {})},
        timeout=timeout,
    )


def run_tool(script: str, *args: str, timeout: float = 300):
    """`python tools/SCRIPT ARGS...`."""
    return run_python(os.path.join("tools", script), *args, timeout=timeout)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single `error: ...` line of a run that must have failed with exit code 2."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]
