"""tools/bench_vs_megatron.py --layouts at the suite's size: tripod and megatron-core 0.16.1
train the same model from the same weights on the same batches under TP1, TP2 with sequence
parallelism, PP2 (1F1B), DP2 with the distributed optimizer and an MoE under EP2, and their
losses agree at every step (fp32: within 1e-5; bf16: within a few times the spread megatron-core
shows against itself between TP1 and TP2). Times and memory are printed, not checked."""

from __future__ import annotations

import json

from tests.requirements import require
from tools import bench_vs_megatron


def test_both_engines_take_the_same_steps_on_every_layout(dataset_prefix, tmp_path):
    require("megatron.core")
    out = tmp_path / "side.json"
    argv = ["--layouts", "all", "--tiny", "--steps", "3", "--data-path", dataset_prefix,
            "--data-vocab-size", "2000", "--json", str(out)]  # fmt: skip
    assert bench_vs_megatron.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["tp1", "tp2-sp", "pp2-1f1b", "dp2-distopt", "ep2-moe"]
    for row in rows:
        ours, theirs = row["tripod"]["losses"], row["megatron"]["losses"]
        assert len(ours) == len(theirs) == 3, row
        assert theirs[-1] < theirs[0], row  # the steps trained something
        assert row["loss_rel_error"] < 1e-5, row
        for engine in ("tripod", "megatron"):
            assert row[engine]["step_s"] > 0 and row[engine]["peak_bytes"] > 0, row


def test_in_bf16_the_difference_is_megatron_cores_own_spread(dataset_prefix, tmp_path):
    """bf16 weights with fp32 masters on both sides. (Found by this comparison: --finetune of
    a Megatron-LM checkpoint left tripod's fp32 masters at their initial values, so the first
    update wrote them over the loaded weights: 400 times the spread. Measured here since:
    0.8 to 1.0 times it.)"""
    require("megatron.core")
    out = tmp_path / "side.json"
    argv = ["--layouts", "tp1", "tp2-sp", "--tiny", "--bf16", "--steps", "3", "--data-path",
            dataset_prefix, "--data-vocab-size", "2000", "--json", str(out)]  # fmt: skip
    assert bench_vs_megatron.main(argv) == 0
    report = json.loads(out.read_text())
    spread = report["megatron_spread"]
    assert 0 < spread < 1e-3, spread
    for row in report["rows"]:
        assert row["loss_rel_error"] <= 3 * spread, (row["layout"], row["loss_rel_error"], spread)
