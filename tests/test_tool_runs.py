"""Tools the other tests do not run, run small, each held to what it promises:
tools/show_schedule.py prints every rank's actions and the bubble the schedule's formula gives,
tools/make_corpus.py writes the same documents as JSONL and Parquet, tools/bench_memory.py
measures what its formulas say at a tiny size, tools/bench_checkpoint.py times a checkpoint of
the size its model has, tools/bench_attention.py counts the attention work its masks leave."""

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


def test_bench_memory_measures_its_formulas_at_a_tiny_size(tmp_path):
    out = tmp_path / "memory.json"
    result = run_tool(
        "bench_memory.py", "--seq-length", "64", "--hidden-size", "64",
        "--num-attention-heads", "4", "--state-layers", "2", "--state-hidden-size", "32",
        "--cp-seq-lengths", "256", "--cp-hidden-size", "32", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    states = report["states"]
    assert {(r["optimizer"], r["strategy"], r["dp"]) for r in states} == {
        (o, s, d)
        for o in ("adam", "muon")
        for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
        for d in (1, 2, 4)
    }
    muon = {(r["strategy"], r["dp"]): r for r in states if r["optimizer"] == "muon"}
    for row in states:  # bytes per parameter against 18, 6 + 12/d, 2 + 16/d, 18/d
        if row["optimizer"] == "adam":  # Muon's weights hold less (master, momentum)
            fewer = muon[row["strategy"], row["dp"]]["bytes"]["optimizer"]
            assert fewer < row["bytes"]["optimizer"], row
        measured = sum(row["bytes"].values()) / row["parameters"]
        assert measured == pytest.approx(row["formula"], rel=0.01), row
    for row in report["activations"]:  # the adjusted count is exact for this layer
        assert row["measured"] == row["formula"] < row["paper"], row
    assert {(r["cp"], r["comm_type"]) for r in report["context_parallel"]} >= {
        (1, "-"), (2, "p2p"), (2, "a2a"), (4, "p2p")
    }  # fmt: skip
    assert "| measured / formula |" in result.stdout


def test_bench_checkpoint_times_a_save_of_the_models_size(tmp_path):
    out = tmp_path / "checkpoint.json"
    result = run_tool(
        "bench_checkpoint.py", "--num-layers", "2", "--hidden-size", "64", "--trials", "1",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    # fp32 weights and two Adam moments, plus the RNG states and the index
    assert 12 * report["params"] <= report["checkpoint_bytes"] <= 12.5 * report["params"]
    seconds = report["seconds"]
    assert set(seconds) == {
        "sync", "async_call", "async_stall", "async_slowdown", "async_total", "write_plain",
        "write_checksums", "verify", "hash_only",
    }  # fmt: skip
    # the next step's slowdown from the background write is 0 where it ran no slower
    assert seconds["async_slowdown"] >= 0, seconds
    assert all(value > 0 for key, value in seconds.items() if key != "async_slowdown"), seconds
    assert seconds["async_call"] <= seconds["async_stall"]  # the stall includes the call
    assert "synchronous (step stalled)" in result.stdout


def test_bench_attention_counts_the_work_its_masks_leave(tmp_path):
    """tools/bench_attention.py --tiny: a row per sequence length and CP size; the work kept
    by documents is the explicit mask's share of the causal one, and the CP ranks' causal
    work is exactly even (the load-balanced chunks)."""
    from engine.model.document_attention import allowed
    from engine.planning.attention_work import document_ids, mixed_documents

    out = tmp_path / "attention.json"
    result = run_tool("bench_attention.py", "--tiny", "--json", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq"], r["cp"]) for r in rows] == [(256, 1), (256, 2), (512, 1), (512, 2)]
    for row in rows:
        layout = mixed_documents(1, row["seq"], 60, seed=row["seq"])
        within = allowed(document_ids(layout)).sum().item()
        causal = row["seq"] * (row["seq"] + 1) // 2
        assert row["work_kept"] == pytest.approx(within / causal)
        assert row["work_kept"] < 0.9 and row["documents_per_sample"] > 1
        assert row["causal_rank_imbalance"] == pytest.approx(1.0)
        assert row["documents_rank_imbalance"] >= 1.0
        assert row["causal_s"] > 0 and row["documents_s"] > 0
    assert re.search(r"^\s+512\s+2\s", result.stdout, re.M), result.stdout
