"""tools/preprocess_data.py --executor ray|slurm: a task per input file, then their merge, gives
the .bin/.idx one process writes, byte for byte (an input file without documents included), on
a local Ray cluster and on a real Slurm (a controller and a node on this machine) with a task
killed once and submitted again; bad input met by a task is one line."""

from __future__ import annotations

import json
import os

import pytest

from engine.execution.sandbox_slurm import SlurmCluster, slurm_available
from tests.cli import one_line_error, run_python
from tests.requirements import require


@pytest.fixture(scope="module")
def inputs(corpus, tmp_path_factory):
    """The built-in corpus cut into three JSONL files, with an empty one between them."""
    folder = tmp_path_factory.mktemp("inputs")
    with open(corpus["jsonl"]) as f:
        lines = f.readlines()[:300]
    third = len(lines) // 3
    for k, chunk in enumerate([lines[:third], [], lines[third : 2 * third], lines[2 * third :]]):
        (folder / f"part-{k}.jsonl").write_text("".join(chunk))
    return folder


def _preprocess(inputs, prefix, tokenizer_model, *extra, env=None):
    return run_python(
        "tools/preprocess_data.py", "--input", str(inputs), "--output-prefix", str(prefix),
        "--tokenizer-model", tokenizer_model, "--append-eod", "--json-keys", "text",
        "--no-progress", *extra, env=env, timeout=600,
    )  # fmt: skip


def _dataset(prefix) -> tuple[bytes, bytes]:
    path = f"{prefix}_text_document"
    with open(f"{path}.bin", "rb") as b, open(f"{path}.idx", "rb") as i:
        return b.read(), i.read()


@pytest.fixture(scope="module")
def reference(inputs, tokenizer_model, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("reference") / "data"
    result = _preprocess(inputs, prefix, tokenizer_model)
    assert result.returncode == 0, result.stderr
    return _dataset(prefix)


def test_a_local_ray_cluster_writes_the_same_dataset(inputs, reference, tokenizer_model, tmp_path):
    require("ray")
    prefix = tmp_path / "data"
    result = _preprocess(inputs, prefix, tokenizer_model, "--executor", "ray", "--workers", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _dataset(prefix) == reference
    assert not os.path.exists(f"{prefix}.parts")  # the parts go once merged
    assert "documents: " in result.stdout


@pytest.mark.skipif(slurm_available() is not None, reason=f"Slurm: {slurm_available()}")
def test_slurm_arrays_write_the_same_dataset(inputs, reference, tokenizer_model, tmp_path):
    with SlurmCluster() as env:
        prefix, flag = tmp_path / "data", tmp_path / "killed-once"
        fault = dict(env, TRIPOD_FAULT_KILL_TASK=f"tokenize:2:{flag}")
        result = _preprocess(inputs, prefix, tokenizer_model, "--executor", "slurm", env=fault)
        assert result.returncode == 0, result.stderr[-3000:]
        assert flag.exists() and _dataset(prefix) == reference
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\nnot json\n")
        result = _preprocess(bad, tmp_path / "b", tokenizer_model, "--executor", "slurm",
                             "--max-retries", "0", env=env)  # fmt: skip
        line = one_line_error(result)
        assert "stage tokenize: task(s) [0] failed 1 times" in line
        assert f"{bad / 'a.jsonl'}:line 2" in line  # the task's own error line
        assert not os.path.exists(tmp_path / "b_text_document.bin")
