"""One run per --save folder: a second run is refused at its start in one line naming the
holder, the first run's checkpoints untouched; a killed run leaves nothing locked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from engine.checkpoint import run_lock
from engine.checkpoint.files import find_latest
from tests.cli import CPU_ONLY, ROOT, one_line_error, run_python
from tests.test_restarts import SMALL_RUN, _read_until, _start


def test_a_second_run_on_the_same_save_folder_is_refused(dataset_prefix, tokenizer_model, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    data = ["--data-path", dataset_prefix, "--tokenizer-type", "SentencePieceTokenizer"]
    data += ["--tokenizer-model", tokenizer_model, "--save", ckpt, "--save-interval", "2"]
    first = _start(
        [sys.executable, "-m", "engine.pretrain", *SMALL_RUN, *data, "--train-iters", "100000"],
        dict(os.environ, **CPU_ONLY),
    )
    try:
        _read_until(first, r"checkpoint saved: .*iter_0000002", [])
        # through the launcher: refused before any rank starts
        second = run_python(
            "-m", "engine.launch", "--standalone", "--nproc-per-node", "2",
            "-m", "engine.pretrain", *SMALL_RUN, *data, timeout=120,
        )  # fmt: skip
        line = one_line_error(second)
        assert line.startswith(f"error: --save {ckpt} is in use by the run of pid {first.pid} on ")
        assert line.endswith("; stop that run or give another --save")
        # without the launcher: refused by its first rank, before it loads or writes anything
        alone = run_python("-m", "engine.pretrain", *SMALL_RUN, *data, timeout=120)
        assert one_line_error(alone) == line
        assert first.poll() is None  # the first run trains on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    latest = find_latest(ckpt)
    assert latest >= 2 and latest % 2 == 0
    run_lock.check_free(ckpt)  # the kernel released the killed run's lock


def test_the_lock_is_held_until_released(tmp_path):
    held = run_lock.hold(str(tmp_path))
    probe = subprocess.run(
        [sys.executable, "-c", f"from engine.checkpoint import run_lock; "
         f"run_lock.check_free({str(tmp_path)!r})"],
        capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
    )  # fmt: skip
    assert "is in use by the run of pid" in probe.stderr
    held.close()
    run_lock.check_free(str(tmp_path))
