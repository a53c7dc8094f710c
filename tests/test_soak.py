"""A soak run: 8 ranks (TP2 x PP2 x DP2) through the launcher, 125 iterations with an async
save every 25. Each rank's resident memory, sampled from outside, does not grow by more than 5%
after the warm-up; every checkpoint verifies against its checksums; the final checkpoint's
files equal, byte for byte, those of the same run without the async saves (the saves changed
nothing in training; that run is forked from the tests' forkserver, sparing 8 interpreter
starts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from engine.checkpoint.files import is_iteration_name, iteration_dir, read_meta
from engine.checkpoint.load import verify_checkpoint
from tests.cli import CPU_ONLY, ROOT
from tests.test_training import pretrain

ITERATIONS, WARM_UP = 125, 40
RUN = [
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1"),
    *("--global-batch-size", "4", "--train-iters", str(ITERATIONS), "--eval-iters", "0"),
    *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
    *("--log-interval", "10",),
]  # fmt: skip


def _rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _ranks(launcher: int) -> list[int]:
    """The rank processes: the launcher's children that run engine.pretrain."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if parent == launcher and b"engine.pretrain" in command:
            found.append(int(name))
    return sorted(found)


def _launch(ckpt: str, *flags: str) -> tuple[str, dict]:
    """Run the job; its output, and each rank's RSS samples as (iteration, KiB)."""
    command = [
        *(sys.executable, "-m", "engine.launch", "--standalone", "--nproc-per-node", "8"),
        *("-m", "engine.pretrain", *RUN, "--save", ckpt, *flags),
    ]
    env = dict(os.environ, **CPU_ONLY, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    samples, ranks = {}, []
    while process.poll() is None:
        done = [int(m.group(1)) for line in output if (m := re.match(r"iteration +(\d+)/", line))]
        iteration = done[-1] if done else 0
        ranks = ranks if len(ranks) == 8 else _ranks(process.pid)
        for pid in ranks:
            if (kib := _rss_kib(pid)) is not None:
                samples.setdefault(pid, []).append((iteration, kib))
        time.sleep(0.5)
    reader.join(timeout=30)
    text = "".join(output)
    assert process.returncode == 0, text[-3000:]
    return text, samples


@pytest.mark.slow
def test_a_soak_run_holds_its_memory_and_loses_nothing(tmp_path):
    soak, plain = str(tmp_path / "soak"), str(tmp_path / "plain")
    text, samples = _launch(soak, "--save-interval", "25", "--async-save")
    assert f"iteration    {ITERATIONS}/{ITERATIONS}" in text
    assert len(samples) == 8
    for pid, series in samples.items():
        settled = [kib for iteration, kib in series if iteration >= WARM_UP]
        assert len(settled) >= 5, series
        growth = max(settled) / settled[0] - 1
        print(f"rank pid {pid}: {settled[0] / 1024:.0f} MiB after warm-up, growth {growth:.1%}")
        assert growth <= 0.05, (pid, series)

    saved = sorted(n for n in os.listdir(soak) if is_iteration_name(n))
    assert saved == [f"iter_{k:07d}" for k in range(25, ITERATIONS + 1, 25)]
    for name in saved:
        verify_checkpoint(os.path.join(soak, name))  # every file against its checksum

    pretrain(8, [*RUN, "--save", plain, "--save-interval", str(ITERATIONS)])
    # the data files (weights, optimizer state, random states) are the same bytes; DCP's own
    # .metadata index records how the save was planned and may differ
    ours = read_meta(iteration_dir(soak, ITERATIONS))["files"]
    theirs = read_meta(iteration_dir(plain, ITERATIONS))["files"]
    ours.pop(".metadata"), theirs.pop(".metadata")
    assert len(ours) == 8 and ours == theirs, json.dumps({"soak": ours, "plain": theirs})[:3000]
