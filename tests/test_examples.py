"""The example scripts run as a user runs them, short: examples/quickstart.sh (corpus to a
Hugging Face export that generates; its data step examples/prepare_data.sh) and
examples/long_context.sh (through examples/pretrain_llama.sh, a 2K phase continued at 8K with
RoPE scaling and context parallelism), each held to what its header promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from engine.checkpoint.files import iteration_dir, read_meta
from tests.cli import CPU_ONLY
from tests.test_training import ROOT

BIN = os.path.dirname(os.path.abspath(sys.executable))


def _bash(script: str, *args: str, timeout: int = 600, **env: str):
    environment = dict(os.environ, **CPU_ONLY, PATH=BIN + os.pathsep + os.environ["PATH"], **env)
    environment.pop("MASTER_PORT", None)
    return subprocess.run(
        ["bash", f"examples/{script}", *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("quickstart")
    data, corpus = root / "data", root / "corpus"
    # (a smaller model than the script's, still one layer per pipeline stage, and one
    # batch per evaluation)
    done = _bash(
        "quickstart.sh", "--lr-warmup-iters", "2", "--num-layers", "2", "--hidden-size", "128",
        "--num-attention-heads", "4", "--eval-iters", "1",
        DATA=str(data), CORPUS=str(corpus), TRAIN_ITERS="10",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return {"data": data, "corpus": corpus, "stdout": done.stdout}


def test_quickstart_trains_evaluates_exports_and_generates(quickstart):
    data, out = quickstart["data"], quickstart["stdout"]
    run = data / "run"
    # the data step wrote where it was told (nothing under the repository's data/)
    assert (quickstart["corpus"] / "stdlib.jsonl").stat().st_size > 0
    assert (data / "tokenizer.model").exists() and (data / "stdlib_text_document.idx").exists()
    # TP2 x PP2 trained 10 iterations and saved the last
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert read_meta(iteration_dir(str(run / "checkpoints"), 10))["layout"]["tp"] == 2
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in logged if "split" not in r][-1] == 10
    assert (run / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the trained model's perplexity is below the same model's untrained
    trained, untrained = (float(m) for m in re.findall(r"perplexity on \S+: ([\d.]+) \(nll", out))
    assert trained < untrained / 2, out[-3000:]
    # the export loads in transformers and generates new text after the prompt
    assert (run / "hf" / "model.safetensors").exists() and (run / "hf" / "config.json").exists()
    samples = re.split(r"-- sample \d .*:\n", out.split("== 7/7")[1])[1:]
    assert len(samples) == 2, out[-3000:]
    for sample in samples:
        assert sample.startswith("    def __init__(self") and len(sample.strip()) > 30


def test_long_context_continues_at_8k_with_rope_scaling_and_context_parallelism(
    quickstart, tmp_path
):
    run = tmp_path / "long"
    # one 8K iteration (its loss is the one compared), no evaluation; the 8K phase's warm-up
    # of 2 needs a decay longer than its single iteration
    done = _bash(
        "long_context.sh", "--lr-decay-iters", "8", "--eval-iters", "0",
        DATA=str(quickstart["data"]), RUN=str(run), ITERS_2K="8", ITERS_8K="1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "fine-tuning from the weights of" in done.stdout
    meta = read_meta(iteration_dir(str(run / "8k"), 1))
    model = meta["model"]
    assert model["seq_length"] == 8192 and model["use_rope_scaling"]
    assert model["rope_scaling_factor"] == 4.0
    assert model["rope_scaling_original_max_position_embeddings"] == 2048
    assert meta["layout"]["cp"] == 2
    assert model["swiglu"] and model["normalization"] == "RMSNorm"  # pretrain_llama.sh's
    assert model["num_query_groups"] == 2

    def train_losses(name):
        lines = (run / f"{name}.jsonl").read_text().splitlines()
        return [r["lm_loss"] for r in map(json.loads, lines) if "split" not in r]

    short, long = train_losses("2k"), train_losses("8k")
    # the 8K phase starts from the 2K phase's weights: its first loss (before any step of its
    # own) is well below a fresh model's, near log(8000) = 8.99 as the 2K phase's first was
    assert long[0] < short[0] - 0.3, (short, long)
