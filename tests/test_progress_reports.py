"""Progress for the outside, on two gloo ranks. --log-straggler with one rank slowed (its
batches take 0.3 s longer to read): the log names it with its node, the JSONL holds every rank's
own time, the other rank's waits for it are not counted as its own, and the dashboard draws the
ranks. --heartbeat-dir: the node's file."""

from __future__ import annotations

import json
import os
import re
import socket
import time

from tests.distributed import run_ranks
from tests.test_rerun import MOCK, _train


def test_a_slow_rank_is_named(tmp_path, capfd):
    log = tmp_path / "log.jsonl"
    argv = [*MOCK, "--train-iters", "4", "--log-interval", "2", "--log-straggler"]
    run_ranks(_train, 2, [*argv, "--log-jsonl", str(log)], {"TRIPOD_FAULT_SLOW_RANK": "1:0.3"})
    out = capfd.readouterr().out
    host = socket.gethostname()
    assert re.search(
        rf"stragglers at iteration 2 \(own compute per iteration, median [\d.]+ s, "
        rf"--straggler-threshold 0.1\): rank 1 \({host}\) \d\.\d\d\d s \(\+\d+%\)",
        out,
    ), out
    assert f"slowest rank 1 ({host})" in out and f"fastest rank 0 ({host})" in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [r for r in records if "own_time_per_rank" in r]
    assert [r["iteration"] for r in logged] == [2, 4]
    for record in logged:
        fast, slow = record["own_time_per_rank"]
        assert slow >= 0.3 > fast  # rank 0 waited for rank 1 in the reduction: not its own
        assert record["own_time_max_over_median"] > 1.0

    from tools import plot_metrics

    png = tmp_path / "dashboard.png"
    assert plot_metrics.main(["--log-jsonl", str(log), "--output", str(png)]) == 0
    assert os.path.getsize(png) > 0


def test_the_heartbeat_file_follows_the_run(tmp_path):
    """--heartbeat-dir: one file per node (the first rank of the node writes it), atomically,
    that ends as finished with the last iteration and the tokens trained."""
    folder = tmp_path / "beats"
    argv = [*MOCK, "--train-iters", "3", "--heartbeat-dir", str(folder)]
    started = time.time()
    run_ranks(_train, 2, argv, {})
    assert os.listdir(folder) == [f"heartbeat_{socket.gethostname()}.json"]
    beat = json.loads((folder / f"heartbeat_{socket.gethostname()}.json").read_text())
    assert beat["state"] == "finished" and beat["iteration"] == 3 and beat["rank"] == 0
    assert beat["consumed_samples"] == 12 and beat["tokens"] == 12 * 32
    assert started <= beat["time"] <= time.time()
