"""lm-evaluation-harness (optional; installed for the tests) evaluating our checkpoint as
`--model tripod`: on a local multiple-choice task its scores equal tools/evaluate.py's and the
harness's own transformers model on the Hugging Face export of the same checkpoint, choice by
choice; the command line runs the same."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.test_evaluate import QUESTIONS, _tool
from tests.test_training import ROOT

pytest.importorskip("lm_eval")

TASK = """task: tripod_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.fixture
def task_dir(tmp_path) -> str:
    data = tmp_path / "task.jsonl"
    lines = [json.dumps({"context": c, "choices": ch, "gold": g}) for c, ch, g in QUESTIONS]
    data.write_text("\n".join(lines) + "\n")
    (tmp_path / "tripod_mc.yaml").write_text(TASK.format(data=data))
    return str(tmp_path)


def _harness(model: str, model_args: str, task_dir: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import engine.eval.lm_eval_adapter  # noqa: F401 - registers "tripod"

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tripod_mc"],
        task_manager=TaskManager(include_path=task_dir),
        num_fewshot=0,
        device="cpu",
        log_samples=True,
    )
    scores = results["results"]["tripod_mc"]
    samples = sorted(results["samples"]["tripod_mc"], key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return {"acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"], "lls": lls}


def test_tripod_model_scores_equal_evaluate_and_transformers(
    small_checkpoint, small_checkpoint_hf, task_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = _harness("tripod", f"load={small_checkpoint}", task_dir)
    theirs = _harness("hf", f"pretrained={small_checkpoint_hf},dtype=float32", task_dir)
    out = tmp_path / "evaluate.json"
    task_file = os.path.join(task_dir, "task.jsonl")
    result = _tool("tools/evaluate.py", "--load", small_checkpoint, "--tasks", task_file,
                   "--output-json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr
    evaluated = json.loads(out.read_text())["tasks"][task_file]
    assert ours["acc"] == theirs["acc"] == evaluated["acc"]
    assert ours["acc_norm"] == theirs["acc_norm"] == evaluated["acc_norm"]
    for a, b, item in zip(ours["lls"], theirs["lls"], evaluated["items"]):
        for x, y, z in zip(a, b, item["loglikelihoods"]):
            assert math.isclose(x, y, abs_tol=1e-4) and math.isclose(x, z, abs_tol=1e-6)
    # the command line, as a user runs it
    result = subprocess.run(
        [sys.executable, "tools/lm_eval_tripod.py", "--model", "tripod", "--model_args",
         f"load={small_checkpoint}", "--tasks", "tripod_mc", "--include_path", task_dir,
         "--device", "cpu"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tripod_mc" in result.stdout and "acc_norm" in result.stdout
