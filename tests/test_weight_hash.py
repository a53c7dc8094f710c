"""--check-weight-hash-across-dp-replicas-interval: replicas that hold the same weights pass
(replicated, or with the distributed optimizer), a replica whose weight drifted stops the run,
through the launcher, with one line naming the parameter and the ranks of each version, and
sharded parameters (no replicas) are refused in one line. The runs that pass are forked from
the tests' forkserver (tests/distributed.py), the failing ones go through the launcher."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_training import ROOT, base_args, pretrain


def _launch(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "engine.launch", "--nproc-per-node", "2", "-m", "engine.pretrain"]
        + args,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


@pytest.mark.parametrize("sharding", [None, "--use-distributed-optimizer", "--use-megatron-fsdp"])
def test_replicas_are_compared_and_a_drifted_one_stops_the_run(
    dataset_prefix, tokenizer_model, sharding, capfd
):
    extra = {"--train-iters": "4", "--check-weight-hash-across-dp-replicas-interval": "2"}
    if sharding:
        extra[sharding] = True
    args = base_args(dataset_prefix, tokenizer_model, **extra) + ["--device", "cpu"]
    if sharding == "--use-megatron-fsdp":  # sharded parameters: no replicas to compare
        refused = _launch(args)
        assert refused.returncode == 2 and "there are no replicas to compare" in refused.stderr
        return
    capfd.readouterr()
    pretrain(2, args)
    found = [x for x in capfd.readouterr().out.splitlines() if x.startswith("weights equal")]
    assert found == [
        "weights equal across data-parallel replicas at 2",
        "weights equal across data-parallel replicas at 4",
    ]
    drifted = _launch(args, {"TRIPOD_FAULT_PERTURB_WEIGHT_AT": "1:4"})
    assert drifted.returncode == 2
    lines = [x for x in drifted.stderr.splitlines() if x.strip()]
    assert lines == [
        "error: weights checked at iteration 4 (--check-weight-hash-across-dp-replicas-interval): "
        "embedding.word_embeddings.weight differs between data-parallel replicas: one on rank 0;"
        " one on rank 1"
    ], drifted.stderr


def test_test_mode_compares_the_qk_norms_across_tensor_parallel_ranks(
    dataset_prefix, tokenizer_model, capfd
):
    """--test-mode (Megatron-LM's real-time test): TP 2 ranks hold the same QK layernorm
    weights; one drifted on rank 1 after iteration 2's update stops the run before iteration
    3 with one line. Without --qk-layernorm there is nothing to compare, as in Megatron-LM."""
    extra = {"--train-iters": "4", "--tensor-model-parallel-size": "2", "--test-mode": True}
    args = base_args(dataset_prefix, tokenizer_model, **extra) + ["--device", "cpu"]
    capfd.readouterr()
    pretrain(2, args)
    assert "--test-mode: no QK layernorm to compare (as in Megatron-LM)" in capfd.readouterr().out
    args += ["--qk-layernorm"]
    pretrain(2, args)
    drifted = _launch(
        args,
        {"TRIPOD_FAULT_PERTURB_WEIGHT_AT": "1:2", "TRIPOD_FAULT_PERTURB_WEIGHT": "k_layernorm"},
    )
    assert drifted.returncode == 2
    lines = [x for x in drifted.stderr.splitlines() if x.strip()]
    assert lines == [
        "error: QK layernorm weights checked before iteration 3 (--test-mode): "
        "layers.0.self_attention.k_layernorm.weight differs between the data- and "
        "tensor-parallel ranks holding it: one on rank 0; one on rank 1"
    ], drifted.stderr
