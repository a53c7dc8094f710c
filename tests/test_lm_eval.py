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

from tests.requirements import require
from tests.test_evaluate import QUESTIONS, _tool
from tests.test_training import ROOT

require("lm_eval")

ROLLING = """task: tripod_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""
GENERATE = """task: tripod_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
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
    texts = tmp_path / "texts.jsonl"
    lines = [
        json.dumps({"text": c + ch[g] * 30, "context": c, "answer": ch[g]})
        for c, ch, g in QUESTIONS
    ]
    texts.write_text("\n".join(lines) + "\n")
    (tmp_path / "tripod_rolling.yaml").write_text(ROLLING.format(data=texts))
    (tmp_path / "tripod_generate.yaml").write_text(GENERATE.format(data=texts))
    return str(tmp_path)


def _harness(model: str, model_args: str, task_dir: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import engine.eval.lm_eval_adapter  # noqa: F401 - registers "tripod"

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tripod_mc"],
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),
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
    for a, b, item in zip(ours["lls"], theirs["lls"], evaluated["items"], strict=True):
        for x, y, z in zip(a, b, item["loglikelihoods"], strict=True):
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


def test_rolling_loglikelihoods_and_generation_equal_transformers(
    small_checkpoint, small_checkpoint_hf, task_dir, monkeypatch
):
    """Documents longer than the model's 32 positions scored in rolling windows, and greedy
    generation until a stop string: the same as the harness's transformers model."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import engine.eval.lm_eval_adapter  # noqa: F401 - registers "tripod"

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    found = {}
    for name, model, args in (
        ("ours", "tripod", f"load={small_checkpoint}"),
        ("theirs", "hf", f"pretrained={small_checkpoint_hf},dtype=float32,max_length=32"),
    ):
        results = simple_evaluate(
            model=model, model_args=args, tasks=["tripod_rolling", "tripod_generate"],
            task_manager=TaskManager(include_path=task_dir, include_defaults=False),
            device="cpu", log_samples=True,
        )  # fmt: skip
        samples = {
            task: sorted(results["samples"][task], key=lambda s: s["doc_id"])
            for task in ("tripod_rolling", "tripod_generate")
        }
        found[name] = {
            "rolling": [float(s["resps"][0][0]) for s in samples["tripod_rolling"]],
            "generated": [s["resps"][0][0] for s in samples["tripod_generate"]],
            "ppl": results["results"]["tripod_rolling"]["word_perplexity,none"],
        }
    for a, b in zip(found["ours"]["rolling"], found["theirs"]["rolling"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (a, b)
    assert math.isclose(found["ours"]["ppl"], found["theirs"]["ppl"], rel_tol=1e-4)
    assert found["ours"]["generated"] == found["theirs"]["generated"]
    assert any(text.strip() for text in found["ours"]["generated"])
