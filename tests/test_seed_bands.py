"""Runs repeated over seeds (engine/monitor/seed_groups.py, tools/plot_metrics.py): real runs
that differ only in --seed form one group whose final loss is printed as mean +- std over them;
a run that differs in anything else stays apart."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from engine.monitor.seed_groups import group_by_seed
from tests.cli import run_tool
from tests.distributed import run_ranks
from tests.test_rerun import _train
from tests.test_restarts import SMALL_RUN


def _final_loss(log) -> float:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if "split" not in r][-1]["lm_loss"]


def test_seed_repeats_are_banded_and_other_runs_stay_apart(
    dataset_prefix, tokenizer_model, tmp_path
):
    data = ["--data-path", dataset_prefix, "--tokenizer-type", "SentencePieceTokenizer"]
    data += ["--tokenizer-model", tokenizer_model, "--train-iters", "4"]
    logs = []
    for name, extra in (("s1", ["--seed", "1"]), ("s2", ["--seed", "2"]),
                        ("s3", ["--seed", "3", "--save", str(tmp_path / "ck")]),
                        ("lr", ["--seed", "1", "--lr", "1e-3"])):  # fmt: skip
        log = tmp_path / name / "metrics.jsonl"
        run_ranks(_train, 1, [*SMALL_RUN, *data, "--log-jsonl", str(log), *extra], {})
        logs.append(log)
    groups = group_by_seed([str(p) for p in logs])
    assert [len(g.paths) for g in groups] == [3, 1] and groups[0].seeds == (1, 2, 3)

    png = tmp_path / "seeds.png"
    result = run_tool("plot_metrics.py", "--log-jsonl", *map(str, logs), "--output", str(png))
    assert result.returncode == 0, result.stderr
    finals = [_final_loss(p) for p in logs[:3]]
    assert len(set(finals)) == 3  # the seeds changed the runs
    printed = re.search(r"s1: final lm loss over seeds 1, 2, 3: ([\d.]+) \+- ([\d.]+) \(3 runs\)",
                        result.stdout)  # fmt: skip
    assert printed, result.stdout
    assert float(printed[1]) == pytest.approx(np.mean(finals), abs=6e-5)
    assert float(printed[2]) == pytest.approx(np.std(finals, ddof=1), abs=6e-5)
    assert "valid lm loss over seeds 1, 2, 3" in result.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
