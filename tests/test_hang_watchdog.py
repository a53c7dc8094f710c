"""--hang-timeout-seconds on real ranks: one rank stops making progress (a stall in compute,
injected), its peers wait in a data-parallel reduction or a pipeline receive; every rank
reports, the verdict names the rank that did not reach the collective, the job exits with the
hang's code, and torchrun's --max-restarts resumes it from the newest checkpoint."""

from __future__ import annotations

import os
import re

from tests.cli import run_python
from tests.test_restarts import SMALL_RUN

MOCK = [*SMALL_RUN, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _launch(*args: str, env: dict, restarts: int = 0):
    return run_python(
        "-m", "engine.launch", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(restarts), "-m", "engine.pretrain", *MOCK,
        "--hang-timeout-seconds", "3", *args,
        env={"OMP_NUM_THREADS": "1", **env}, timeout=240,
    )  # fmt: skip


def test_a_rank_stalled_in_compute_is_named_by_its_data_parallel_peer(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    result = _launch("--save", ckpt, env={"TRIPOD_FAULT_STALL_AT": "1:3"})
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    assert re.search(
        r"rank 0: no progress for \d+ s \(--hang-timeout-seconds 3\); waiting in all_reduce on "
        r"group dp \[0, 1\] \(sequence \d+\), at parallel/data_parallel/\S+\.py:\d+",
        err,
    ), err[-3000:]
    assert "rank 1: no progress" in err and "not in a collective, at engine/train/faults.py" in err
    assert re.search(
        r"hang: rank 1 \(\S+\) did not reach the collective its peers wait in on group [^;]*"
        r"dp \[0, 1\][^;]*; it is at engine/train/faults.py:\d+ in before_iteration",
        err,
    ), err[-3000:]
    # (whichever rank exits first is the failure torchrun reports; it ends the other)
    assert re.search(
        r"error: rank \d stopped on a hang \(exit code 75, --hang-timeout-seconds\)", err
    )
    for rank in (0, 1):  # each rank's Python stack, written beside the checkpoints
        with open(os.path.join(ckpt, "hang_stacks", f"rank_0000{rank}.txt")) as f:
            assert "engine/train/loop.py" in f.read()


def test_a_pipeline_hang_is_named_and_the_restart_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    result = _launch(
        "--pipeline-model-parallel-size", "2", "--train-iters", "8", "--save", ckpt,
        "--load", ckpt, "--save-interval", "2",
        env={"TRIPOD_FAULT_STALL_AT": "0:5", "TRIPOD_FAULT_ATTEMPT": "0"}, restarts=1,
    )  # fmt: skip
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, err[-3000:]
    assert "rank 1: no progress" in err
    assert "waiting in Work.wait (a send, receive or reduction posted earlier)" in err
    assert re.search(
        r"hang: rank 0 \(\S+\) did not reach the collective its peers wait in on group pp "
        r"\[0, 1\]; it is at engine/train/faults.py",
        err,
    ), err[-3000:]
    assert "attempt 1 ended: local rank 0 stopped on a hang" in err
    assert f"resumed from {ckpt}/iter_0000004 at iteration 4" in out
    assert "iteration      8/8" in out
