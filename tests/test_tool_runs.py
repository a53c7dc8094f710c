"""Tools the other tests do not run, run small, each held to what it promises:
tools/show_schedule.py prints every rank's actions and the bubble the schedule's formula gives,
tools/make_corpus.py writes the same documents as JSONL and Parquet."""

from __future__ import annotations

import json
import re

import pytest

from tests.cli import run_tool


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_show_schedule_prints_each_ranks_actions_and_the_1f1b_bubble(pp, m):
    result = run_tool(
        "show_schedule.py", "--schedule", "1f1b", "--pp", str(pp), "--microbatches", str(m)
    )
    assert result.returncode == 0, result.stderr
    actions = re.findall(r"^rank (\d+): (.*)$", result.stdout, re.M)
    assert [int(rank) for rank, _ in actions] == list(range(pp))
    for _, line in actions:  # one forward and one backward of every micro-batch, in order
        steps = line.split()
        assert sorted(steps) == sorted(
            [f"F0.{i}" for i in range(m)] + [f"B0.{i}" for i in range(m)]
        )
        forwards = [s for s in steps if s.startswith("F")]
        assert forwards == [f"F0.{i}" for i in range(m)]
    bubbles = [float(b) for b in re.findall(r"bubble ([\d.]+)%", result.stdout)]
    # 1F1B's bubble: (p - 1) / (m + p - 1) of the step on every rank
    assert bubbles == pytest.approx([100 * (pp - 1) / (m + pp - 1)] * pp, abs=0.05)


def test_show_schedule_zero_bubble_splits_the_backward():
    result = run_tool("show_schedule.py", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4")
    assert result.returncode == 0, result.stderr
    for _, line in re.findall(r"^rank (\d+): (.*)$", result.stdout, re.M):
        steps = line.split()
        for kind in "FIW":  # input and weight gradients apart, each micro-batch once
            assert sorted(s for s in steps if s[0] == kind) == [f"{kind}0.{i}" for i in range(4)]
        assert not any(s[0] == "B" for s in steps)


def test_make_corpus_writes_the_same_documents_as_jsonl_and_parquet(tmp_path):
    import pyarrow.parquet as pq

    result = run_tool("make_corpus.py", "--output-dir", str(tmp_path), "--max-bytes", "200000")
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "stdlib.jsonl") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(texts) > 10 and all(texts)
    assert 100_000 < sum(len(t.encode()) for t in texts) <= 200_000  # up to --max-bytes
    assert pq.read_table(tmp_path / "stdlib.parquet").column("text").to_pylist() == texts
