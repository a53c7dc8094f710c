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


def run_tool(script: str, *args: str, timeout: float = 300, env: dict | None = None):
    """`python tools/SCRIPT ARGS...`, run as run_forked runs it (the tests of the command line
    itself use run_python)."""
    return run_forked(f"tools.{script.removesuffix('.py')}", *args, timeout=timeout, env=env)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single `error: ...` line of a run that must have failed with exit code 2."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


def _main_in_a_fork(rank, world_size, module: str, argv: list[str], environ: dict):
    """In a rank of tests.distributed.run_ranks: MODULE's main(argv) as `python -m MODULE`
    from the repository root would run it (no process group, the caller's environment, its
    argv), its exit code and output."""
    import contextlib
    import importlib
    import io

    import torch.distributed as dist

    from engine.cli import run_main

    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(ROOT)
    loaded = importlib.import_module(module)
    sys.argv = [loaded.__file__, *argv]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_main(loaded.main, argv)
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else int(end.code is not None)
    return code, out.getvalue(), err.getvalue()


def run_forked(
    module: str, *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS...` in a process forked from the tests' forkserver, which has
    imported torch and the engine already: the same main, exit code and output (a Python
    traceback fails the test instead), without the seconds a new interpreter spends on imports
    (one thread, as the tests' ranks). The tests of a command line itself use run_python."""
    from tests.distributed import run_ranks

    environ = {**ENV, **(env or {})}
    [(code, out, err)] = run_ranks(_main_in_a_fork, 1, module, list(args), environ, timeout=timeout)
    return subprocess.CompletedProcess([module, *args], code, out, err)
