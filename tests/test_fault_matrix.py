"""tools/fault_matrix.py on the faults no other test injects through the launcher: a rank
killed while it waits on a pipeline transfer, killed during an async save's background commit,
and a full disk during a save; each restarted from the newest complete checkpoint with the same
final losses as a run without the fault. (Kills at a step's start, stalls and NaNs: test_restarts,
test_hang_watchdog, test_rerun; the whole matrix: docs/scale.md.)"""

from __future__ import annotations

import json

from tests.cli import run_tool


def test_faults_are_recovered_with_nothing_lost(tmp_path):
    out = tmp_path / "matrix.json"
    names = "kill-pipeline,kill-async-commit,disk-full"
    result = run_tool("fault_matrix.py", "--only", names, "--json", str(out), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)
    outcomes = {o["name"]: o for o in json.loads(out.read_text())}
    assert set(outcomes) == set(names.split(","))
    for o in outcomes.values():
        assert o["equal"] and o["exit_code"] == 0, o
        assert o["resume_s"] < 60  # from the detection to training again
    assert outcomes["kill-pipeline"]["detected_by"] == "the rank's exit (torchrun)"
    assert outcomes["disk-full"]["detected_by"] == "the save (ENOSPC, exit 2)"
    # the async save of iteration 4 never committed: the restart went back to iteration 2
    assert outcomes["kill-async-commit"]["iterations_lost"] >= 2
