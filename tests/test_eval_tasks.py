"""Benchmarks during training (--eval-tasks, engine/eval/tasks_in_training.py): scored under
TP2 x PP2 with sequence parallelism, the run's task scores at each checkpoint equal those of
tools/evaluate.py on that checkpoint (one process, the same scoring code), which its --watch
mode finds as they appear; a bad task file is one line before training."""

from __future__ import annotations

import json

import pytest

from tests.cli import one_line_error, run_python, run_tool
from tests.test_evaluate import QUESTIONS
from tests.test_training import base_args, pretrain, records


def test_tasks_scored_in_training_equal_the_evaluation_tool(
    dataset_prefix, tokenizer_model, tmp_path
):
    task = tmp_path / "code.jsonl"
    lines = [json.dumps({"context": c, "choices": ch, "gold": g}) for c, ch, g in QUESTIONS]
    task.write_text("\n".join(lines * 3) + "\n")
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = base_args(
        dataset_prefix, tokenizer_model,
        **{"--train-iters": "4", "--save": str(save), "--save-interval": "2",
           "--log-jsonl": str(log), "--eval-tasks": str(task), "--eval-tasks-interval": "2",
           "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
           "--sequence-parallel": True, "--micro-batch-size": "2", "--global-batch-size": "4"},
    )  # fmt: skip
    assert pretrain(4, args) == [0] * 4
    scored = {r["iteration"]: r for r in records(log) if r.get("split") == "tasks"}
    assert sorted(scored) == [2, 4]

    watched = tmp_path / "watch.jsonl"
    result = run_tool(
        "evaluate.py", "--load", str(save), "--tasks", str(task), "--watch",
        "--watch-timeout", "0", "--output-jsonl", str(watched),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = {r["iteration"]: r for r in map(json.loads, watched.read_text().splitlines())}
    assert sorted(found) == [2, 4]
    for iteration in (2, 4):
        ours, tool = scored[iteration], found[iteration]
        for key in ("acc/code", "acc_norm/code"):
            assert ours[key] == tool[key], (iteration, key)
        assert ours["gold_ll/code"] == pytest.approx(tool["gold_ll/code"], rel=1e-5)
    assert scored[2]["gold_ll/code"] != scored[4]["gold_ll/code"]  # the model moved

    again = run_tool("evaluate.py", "--load", str(save), "--tasks", str(task), "--watch",
                     "--watch-timeout", "0", "--output-jsonl", str(watched))  # fmt: skip
    assert again.returncode == 0 and "evaluating" not in again.stdout  # nothing new to score


def test_a_bad_task_file_is_one_line_before_training(dataset_prefix, tokenizer_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": ["a"], "gold": 3}\n')
    args = base_args(dataset_prefix, tokenizer_model, **{"--eval-tasks": str(bad)})
    result = run_python("-m", "engine.pretrain", *args)
    assert "bad.jsonl:line 1: gold 3 is not an index" in one_line_error(result)
