"""A job that torchrun restarts (examples/pretrain_gpt.sh with MAX_RESTARTS): a rank killed in
the middle of training, every rank restarted, training resumed from the newest checkpoint under
--save with the same losses, and the time from the death to training again measured; and a job
stopped by a signal to its launcher, which saves first."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.checkpoint.files import find_latest
from engine.train.exit_conditions import SAME_STOP_SECONDS, ExitConditions
from tests.cli import CPU_ONLY, ROOT

SMALL_RUN = [
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
    *("--global-batch-size", "4", "--train-iters", "10", "--lr-warmup-iters", "1"),
    *("--eval-iters", "1", "--eval-interval", "100", "--split", "90,10,0"),
    *("--log-interval", "1"),
]
TP2_RUN = [*SMALL_RUN, "--tensor-model-parallel-size", "2", "--save-interval", "4"]


def _timed_lines(command: list[str], env: dict, timeout: float) -> tuple[int, list]:
    """Run `command`; its exit code and each output line with the time it arrived."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    stopper = threading.Timer(timeout, process.kill)  # a silent, stuck job ends too
    stopper.start()
    lines = [(time.monotonic(), line.rstrip("\n")) for line in process.stdout]
    stopper.cancel()
    return process.wait(timeout=30), lines


def test_a_killed_rank_restarts_every_rank_from_the_newest_checkpoint(
    dataset_prefix, tokenizer_model, tmp_path
):
    ckpt, log = str(tmp_path / "ckpt"), tmp_path / "log.jsonl"
    env = dict(os.environ, **CPU_ONLY, NPROC_PER_NODE="2", PYTHON=sys.executable)
    env |= {"MAX_RESTARTS": "1", "TRIPOD_FAULT_KILL_AT": "1:6", "TRIPOD_FAULT_ATTEMPT": "0"}
    env.pop("MASTER_PORT", None)
    command = [
        *("bash", "examples/pretrain_gpt.sh", *TP2_RUN, "--data-path", dataset_prefix),
        *("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer_model),
        *("--save", ckpt, "--load", ckpt, "--log-jsonl", str(log)),
    ]
    code, lines = _timed_lines(command, env, timeout=300)
    text = "\n".join(line for _, line in lines)
    assert code == 0, text[-3000:]
    assert "attempt 1 ended: local rank 1 was killed by SIGKILL" in text
    assert "attempt 2 of 2 (attempt 1 ended: local rank 1 was killed by SIGKILL)" in text
    assert f"resumed from {ckpt}/iter_0000004 at iteration 4 (exactly" in text

    # iteration 5 ran in both attempts (the kill came at the start of 6): the same loss
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [(r["iteration"], r["lm_loss"]) for r in records if "split" not in r]
    assert [i for i, _ in losses] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
    assert losses[4] == losses[5]

    # from the last line the killed attempt printed to the restarted attempt's first iteration
    iteration_5 = [t for t, line in lines if re.match(r"iteration +5/10", line)]
    back_in = iteration_5[1] - iteration_5[0]
    print(f"\nfrom a rank's death to training again: {back_in:.1f} s")
    assert back_in < 60


def _start(command: list[str], env: dict, timeout: float = 300) -> subprocess.Popen:
    """The command running, killed after `timeout` seconds whatever it is doing."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=interruptible,
    )  # fmt: skip
    threading.Timer(timeout, process.kill).start()
    return process


def interruptible() -> None:
    """In the child before it starts: SIGINT at its default, so that Python turns it into
    KeyboardInterrupt (a process started with SIGINT ignored, as pytest-xdist's workers run,
    keeps ignoring it, as a shell's background job does)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_until(process: subprocess.Popen, pattern: str, seen: list[str]) -> None:
    for line in process.stdout:
        seen.append(line.rstrip("\n"))
        if re.search(pattern, line):
            return
    raise AssertionError("the run ended before " + pattern + ":\n" + "\n".join(seen[-40:]))


def test_sigterm_to_the_launcher_saves_through_the_data_loader_workers(
    dataset_prefix, tokenizer_model, tmp_path
):
    """`kill` of examples/pretrain_gpt.sh (the launcher): the ranks alone are passed the signal,
    their data-loader workers ignore it, and --exit-signal-handler saves before they exit."""
    ckpt = str(tmp_path / "ckpt")
    env = dict(os.environ, **CPU_ONLY, NPROC_PER_NODE="2", PYTHON=sys.executable)
    env.pop("MASTER_PORT", None)
    run = [*TP2_RUN, "--train-iters", "100000", "--save-interval", "100000"]
    command = [
        *("bash", "examples/pretrain_gpt.sh", *run, "--data-path", dataset_prefix),
        *("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer_model),
        *("--save", ckpt, "--exit-signal-handler", "--num-workers", "2"),
    ]
    process, seen = _start(command, env), []
    _read_until(process, r"iteration +3/", seen)
    process.send_signal(signal.SIGTERM)
    seen += process.stdout.read().splitlines()
    code = process.wait(timeout=60)
    text = "\n".join(seen)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert "Traceback" not in text and "killed by signal" not in text, text[-3000:]
    saved = re.search(r"checkpoint saved: .*iter_(\d+)", text)
    assert saved, text[-3000:]
    assert find_latest(ckpt) == int(saved.group(1)) >= 3
    assert "stopped by SIGTERM" in text


def test_an_interrupt_stops_at_once_and_names_the_latest_checkpoint(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Ctrl-C without --exit-signal-handler (or a second one with it): the run stops without
    waiting, in one line naming the newest complete checkpoint, exit code 130."""
    ckpt = str(tmp_path / "ckpt")
    command = [
        *(sys.executable, "-m", "engine.pretrain", *SMALL_RUN, "--data-path", dataset_prefix),
        *("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer_model),
        *("--train-iters", "100000", "--save", ckpt, "--save-interval", "2"),
    ]
    process, seen = _start(command, dict(os.environ, **CPU_ONLY)), []
    _read_until(process, r"checkpoint saved: .*iter_0000004", seen)
    process.send_signal(signal.SIGINT)
    seen += process.stdout.read().splitlines()
    assert process.wait(timeout=30) == 130, "\n".join(seen[-30:])
    latest = find_latest(ckpt)
    assert latest >= 4
    assert f"interrupted; latest checkpoint {latest} in {ckpt}" in seen
    assert not any("Error" in line or "Traceback" in line for line in seen), seen[-20:]


def test_the_exit_signal_handler_saves_on_the_first_signal_and_stops_on_the_second():
    before = signal.getsignal(signal.SIGINT)  # (ignored in pytest-xdist's workers)
    conditions = ExitConditions(None, signal_handler=True, signal_name="SIGUSR1")
    try:
        assert conditions.check(None, torch.device("cpu")) is None
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the launcher passes it on
        assert conditions.check(None, torch.device("cpu")) == (
            "received SIGINT (--exit-signal-handler)"
        )
        os.kill(os.getpid(), signal.SIGUSR1)  # at once: the same stop (Slurm and the launcher)
        conditions.received_at -= SAME_STOP_SECONDS  # later: another one
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        conditions.close()
    assert signal.getsignal(signal.SIGINT) is before
