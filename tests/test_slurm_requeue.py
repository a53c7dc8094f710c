"""examples/slurm/pretrain_gpt.sbatch on a real Slurm (a controller and a node on this
machine): the signal Slurm sends before the time limit (`--signal=B:USR1@180`, sent here with
`scancel --signal=USR1 --batch`) makes the ranks save through --exit-signal-handler, the job
requeues itself, and its second start resumes from that checkpoint and finishes."""

from __future__ import annotations

import os
import re
import socket
import sys
import time

import pytest

from engine.execution.sandbox_slurm import SlurmCluster, slurm_available
from tests.cli import ROOT

RUN = [
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
    *("--global-batch-size", "4", "--train-iters", "400", "--log-interval", "5"),
    *("--eval-iters", "1", "--eval-interval", "1000", "--save-interval", "1000"),
]


def _wait(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(slurm_available() is not None, reason=f"Slurm: {slurm_available()}")
def test_the_slurm_example_saves_requeues_and_resumes(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "job.out")
    cluster = SlurmCluster()
    with cluster as env:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        env = dict(env, PYTHON=sys.executable, NPROC_PER_NODE="2", MASTER_PORT=port)
        env |= {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
        cluster.env = env
        submitted = cluster.run(
            "sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--chdir={ROOT}",
            f"--output={out}", "examples/slurm/pretrain_gpt.sbatch",
            *RUN, "--save", ckpt, "--load", ckpt,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip()

        def log() -> str:
            return open(out).read() if os.path.exists(out) else ""

        _wait(lambda: re.search(r"iteration +10/", log()), 120, "iteration 10")
        assert cluster.run("scancel", "--signal=USR1", "--batch", job).returncode == 0

        def pending() -> bool:
            return cluster.run("squeue", "-h", "-t", "PD", "-j", job).stdout.strip() != ""

        _wait(pending, 60, "the job back in the queue")
        # Slurm holds a requeued job back for its credentials' lifetime (minutes); start it
        # sooner, but not within the second its old credential was revoked (slurmd refuses a
        # credential made in that second: "Job credential revoked", and the job ends)
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now+3")
        # (squeue can list nothing for a moment while the job is requeued: read the job's output)
        _wait(lambda: re.search(r"start 2 on[\s\S]*peak memory per rank", log()), 240, "the end")
    text = log()
    saved = re.search(r"checkpoint saved: .*iter_(\d+)", text)
    assert saved and "received SIGTERM (--exit-signal-handler)" in text, text[-3000:]
    assert "time limit near (SIGUSR1): the ranks save" in text
    assert f"job {job}, start 2 on" in text
    iteration = int(saved.group(1))
    assert f"resumed from {ckpt}/iter_{iteration:07d} at iteration {iteration} (exactly" in text
    assert "iteration    400/400" in text and "Traceback" not in text, text[-3000:]
