"""tools/test_lanes.py: which test files (and functions) share `make test`'s workers, from a
measured log."""

from __future__ import annotations

import json

from tests.cli import one_line_error, run_tool
from tools.test_lanes import is_shared, shared_files


def test_files_that_kept_one_core_busy_are_listed_and_a_bad_log_is_one_line(tmp_path):
    log = tmp_path / "cpu.jsonl"
    records = [
        {"test": "tests/test_one_core.py::test_a", "wall_s": 10.0, "busy_s": 10.5},
        {"test": "tests/test_one_core.py::test_b", "wall_s": 2.0, "busy_s": 2.0},
        {"test": "tests/test_ranks.py::test_c[tp2]", "wall_s": 10.0, "busy_s": 19.0},
        # one core on average, but one test's ranks filled the machine: not shared
        {"test": "tests/test_mixed.py::test_d", "wall_s": 30.0, "busy_s": 30.0},
        {"test": "tests/test_mixed.py::test_e", "wall_s": 4.0, "busy_s": 7.6},
        # too short for its ratio to count
        {"test": "tests/test_one_core.py::test_f", "wall_s": 0.5, "busy_s": 0.9},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    listed = tmp_path / "shared.txt"
    done = run_tool("test_lanes.py", str(log), "--write", "--output", str(listed))
    assert done.returncode == 0, done.stderr
    # the mixed file's one-core function shares the workers; its ranks' function does not
    expected = ["test_mixed.py::test_d", "test_one_core.py"]
    lines = listed.read_text().splitlines()
    assert [line for line in lines if not line.startswith("#")] == expected
    listed_now = shared_files(str(listed))  # what tests/conftest.py reads
    assert listed_now == set(expected)
    assert is_shared(listed_now, "test_one_core.py", "test_new")  # a whole file: any test
    assert is_shared(listed_now, "test_mixed.py", "test_d")
    assert not is_shared(listed_now, "test_mixed.py", "test_e")
    assert not is_shared(listed_now, "test_mixed.py", "test_new")  # not measured: serial
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()}
    assert rows["test_one_core.py"][1:] == ["12.5", "13.4", "1.07", "1.05", "shared"]
    assert rows["test_ranks.py"][1:] == ["10.0", "19.0", "1.90", "1.90", "serial"]
    assert rows["test_mixed.py"][1:] == ["34.0", "37.6", "1.11", "1.90", "serial"]

    log.write_text('{"test": "tests/test_x.py::t", "wall_s": 1.0}\n')
    done = run_tool("test_lanes.py", str(log))
    assert done.returncode == 2
    assert "line 1 is not a test record" in one_line_error(done)
