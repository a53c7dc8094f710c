"""tools/evaluate.py against transformers: the same checkpoint, exported to Hugging Face, scored
by transformers' own forward with the exported tokenizer, must give the same per-choice
log-likelihoods, accuracies and perplexity; loading the export itself gives them too."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch

from engine.eval.multiple_choice import encode_pair, fewshot_prefix, read_task
from engine.eval.perplexity import windows
from tests.test_training import ROOT

QUESTIONS = [
    ("import os\nimport", [" sys", " the", " 42 apples"], 0),
    ("def __init__(self", ["):", " banana split", ", *args, **kwargs):"], 2),
    ("for i in range(", ["10):", "the sky is blue", "len(items)):"], 1),
    ("class Foo(", ["object):", "!!", "nothing at all"], 0),
    ("return self.", ["value", "@@@", "x y z"], 0),
]


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1"),
        timeout=300,
    )


def _transformers_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """The harness's rule for a causal model, written against transformers directly."""

    class Encoder:
        @staticmethod
        def tokenize(text):
            return tokenizer(text, add_special_tokens=False)["input_ids"]

    context_ids, continuation_ids = encode_pair(Encoder, context, continuation)
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)[-len(continuation_ids) :]
    return float(logprobs.gather(1, torch.tensor(continuation_ids)[:, None]).sum())


def test_scores_equal_transformers_on_the_export(
    small_checkpoint, small_checkpoint_hf, dataset_prefix, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = tmp_path / "task.jsonl"
    lines = [json.dumps({"context": c, "choices": ch, "gold": g}) for c, ch, g in QUESTIONS]
    task.write_text("\n".join(lines) + "\n")
    results = {}
    for name, load in (("ours", small_checkpoint), ("export", small_checkpoint_hf)):
        for shots in (0, 1):
            out = tmp_path / f"{name}{shots}.json"
            result = _tool(
                "tools/evaluate.py", "--load", load, "--tasks", str(task),
                "--num-fewshot", str(shots), "--perplexity-data", dataset_prefix,
                "--perplexity-windows", "3", "--output-json", str(out), "--compare-untrained",
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            assert "acc_norm" in result.stdout and "perplexity" in result.stdout
            results[name, shots] = json.loads(out.read_text())

    model = AutoModelForCausalLM.from_pretrained(small_checkpoint_hf).eval()
    tokenizer = AutoTokenizer.from_pretrained(small_checkpoint_hf)
    questions = read_task(str(task))
    for shots in (0, 1):
        ours = results["ours", shots]["tasks"][str(task)]
        right = right_norm = 0
        for index, (question, item) in enumerate(zip(questions, ours["items"], strict=True)):
            prefix = fewshot_prefix(questions, index, shots, 1234, " ", "\n\n")
            expected = [
                _transformers_loglikelihood(model, tokenizer, prefix + question.context, " " + c)
                for c in question.choices
            ]
            for found, want in zip(item["loglikelihoods"], expected, strict=True):
                assert math.isclose(found, want, rel_tol=1e-4, abs_tol=1e-4), (found, want)
            best = max(range(len(expected)), key=expected.__getitem__)
            norm = [ll / len(c) for ll, c in zip(expected, question.choices, strict=True)]
            right += best == question.gold
            right_norm += max(range(len(norm)), key=norm.__getitem__) == question.gold
        assert ours["acc"] == right / len(questions)
        assert ours["acc_norm"] == right_norm / len(questions)
        exported_scores = results["export", shots]["tasks"][str(task)]
        assert exported_scores["acc"] == ours["acc"]
        for a, b in zip(exported_scores["items"], ours["items"], strict=True):
            pairs = zip(a["loglikelihoods"], b["loglikelihoods"], strict=True)
            assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in pairs)

    # perplexity: transformers' mean loss over the same windows
    length = model.config.max_position_embeddings
    total = count = 0
    for window in windows(dataset_prefix, length, 3):
        ids = torch.tensor([window])
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1]).logits[0].double()
        nll = -torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).sum()
        total, count = total + float(nll), count + len(window) - 1
    ours = results["ours", 0]["perplexity"]
    assert ours["tokens"] == count
    assert math.isclose(ours["nll"], total / count, rel_tol=1e-5)
    # the baseline: the same model freshly initialised scores differently, the same each time
    untrained = [results[key]["untrained"]["perplexity"]["nll"] for key in results]
    assert len(set(untrained)) == 1 and abs(untrained[0] - ours["nll"]) > 1e-3


def test_bad_task_files_are_one_line(small_checkpoint, tmp_path):
    cases = {
        "not json": "{oops\n",
        "gold out of range": json.dumps({"context": "a", "choices": ["b"], "gold": 3}) + "\n",
        "no choices": json.dumps({"context": "a", "gold": 0}) + "\n",
    }
    for text in cases.values():
        task = tmp_path / "bad.jsonl"
        task.write_text(text)
        result = _tool("tools/evaluate.py", "--load", small_checkpoint, "--tasks", str(task))
        assert result.returncode == 2
        [line] = result.stderr.strip().splitlines()
        assert f"{task}:line 1" in line, line
    task.write_text(json.dumps({"context": "a", "choices": ["b"], "gold": 0}) + "\n")
    result = _tool("tools/evaluate.py", "--load", str(tmp_path / "nothing"), "--tasks", str(task))
    assert result.returncode == 2 and "no checkpoint here" in result.stderr, result.stderr
