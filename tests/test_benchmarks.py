"""The pipeline and data-parallel benchmarks run end to end on tiny models and write the
tables their closing-note numbers come from (timings are not checked: numbers, not asserts)."""

from __future__ import annotations

import json

from tools import bench_ddp, bench_pipeline

TINY = ["--hidden-size", "64", "--seq-length", "16", "--warmup", "0", "--steps", "1"]


def test_bench_pipeline_rows(tmp_path):
    out = tmp_path / "pipeline.json"
    argv = ["--pp", "2", "--microbatches", "2", "--num-layers", "4", *TINY, "--json", str(out)]
    assert bench_pipeline.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["schedule"] for r in rows] == [
        "gpipe",
        "1f1b",
        "interleaved",
        "interleaved+overlap",
    ]
    for r in rows:
        assert r["measured_s"] > 0 and r["stage_s"] > 0
        v = 2 if r["schedule"].startswith("interleaved") else 1
        assert abs(r["ideal_bubble"] - (1 - 2 / (2 + 1 / v))) < 1e-12


def test_bench_ddp_rows(tmp_path):
    out = tmp_path / "ddp.json"
    argv = ["--num-layers", "1", "--vocab-size", "128", "--repeats", "1", *TINY]
    assert bench_ddp.main([*argv, "--micro-batch-size", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == [
        "DP=1 (baseline)",
        "2 x DP=1 side by side",
        "DP=2, overlap off",
        "DP=2, overlap on",
    ]
    assert rows[0]["efficiency"] == 1.0
    assert all(r["seconds_per_step"] > 0 and len(r["each_launch"]) == 1 for r in rows)
