"""tools/evaluate.py against lm-evaluation-harness's Hugging Face model: the same checkpoint,
exported to Hugging Face and scored by the harness (its tokenization, its context/continuation
split, transformers' forward), must give the same per-choice log-likelihoods, accuracies and
perplexity (windows read with megatron-core's reader); loading the export itself gives them too."""

from __future__ import annotations

import json
import math
import os
import subprocess

import numpy as np

from tests.cli import run_tool
from tests.requirements import require

QUESTIONS = [
    ("import os\nimport", [" sys", " the", " 42 apples"], 0),
    ("def __init__(self", ["):", " banana split", ", *args, **kwargs):"], 2),
    ("for i in range(", ["10):", "the sky is blue", "len(items)):"], 1),
    ("class Foo(", ["object):", "!!", "nothing at all"], 0),
    ("return self.", ["value", "@@@", "x y z"], 0),
]


def _tool(script: str, *args: str) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS...` (a tools/ script), run forked as tests/cli.py's run_tool runs
    it (the same main, exit code and output, without a new interpreter's imports)."""
    return run_tool(os.path.basename(script), *args, env={"HF_HUB_OFFLINE": "1"})


def _harness_model(folder: str):
    """lm-evaluation-harness's own Hugging Face model on the export: it tokenizes, splits
    context from continuation and scores, with none of our functions."""
    require("lm_eval")
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=folder, dtype="float32", device="cpu", batch_size=1)


def _harness_loglikelihoods(harness, requests: list[tuple[str, str]]) -> list[float]:
    from lm_eval.api.instance import Instance

    instances = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=k)
        for k, pair in enumerate(requests)
    ]
    return [ll for ll, _ in harness.loglikelihood(instances, disable_tqdm=True)]


def _dataset_windows(prefix: str, length: int, count: int) -> list[list[int]]:
    """The first `count` windows of `length` + 1 tokens of the documents joined in order, read
    with megatron-core's own reader of the .bin/.idx files."""
    require("megatron.core")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    stream = np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64)
    step = length + 1
    return [stream[k * step : (k + 1) * step].tolist() for k in range(count)]


def test_scores_equal_transformers_on_the_export(
    small_checkpoint, small_checkpoint_hf, dataset_prefix, tmp_path
):
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

    harness = _harness_model(small_checkpoint_hf)
    for shots in (0, 1):
        ours = results["ours", shots]["tasks"][str(task)]
        right = right_norm = 0
        for index, item in enumerate(ours["items"]):
            context, choices, gold = QUESTIONS[index]
            # the solved examples our run says it showed, joined as the harness's defaults join
            # them (" " before an answer, a blank line between examples)
            assert len(item["shots"]) == shots and index not in item["shots"]
            solved = [
                QUESTIONS[k][0] + " " + QUESTIONS[k][1][QUESTIONS[k][2]] for k in item["shots"]
            ]
            prefix = "".join(example + "\n\n" for example in solved)
            expected = _harness_loglikelihoods(
                harness, [(prefix + context, " " + c) for c in choices]
            )
            for found, want in zip(item["loglikelihoods"], expected, strict=True):
                assert math.isclose(found, want, rel_tol=1e-4, abs_tol=1e-4), (found, want)
            best = max(range(len(expected)), key=expected.__getitem__)
            norm = [ll / len(c) for ll, c in zip(expected, choices, strict=True)]
            right += best == gold
            right_norm += max(range(len(norm)), key=norm.__getitem__) == gold
        assert ours["acc"] == right / len(QUESTIONS)
        assert ours["acc_norm"] == right_norm / len(QUESTIONS)
        exported_scores = results["export", shots]["tasks"][str(task)]
        assert exported_scores["acc"] == ours["acc"]
        for a, b in zip(exported_scores["items"], ours["items"], strict=True):
            pairs = zip(a["loglikelihoods"], b["loglikelihoods"], strict=True)
            assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in pairs)

    # perplexity: the harness's model's summed log-likelihood over the same windows, each
    # window's first token the context of the rest
    length = harness.max_length
    total = count = 0
    for window in _dataset_windows(dataset_prefix, length, 3):
        [(ll, _)] = harness._loglikelihood_tokens([(("", ""), window[:1], window[1:])])
        total, count = total - ll, count + len(window) - 1
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
