"""Mixture-of-experts runs through the training entry point: a sigmoid router with expert bias
on 2 data-parallel ranks resumes bit-exactly from its checkpoint (the expert bias saved with
it), whose Hugging Face export is refused in one line (no equivalent) and whose Megatron-LM
export comes back bit for bit, and bad MoE flags are refused in one line naming the flag and
the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.errors import ConfigError
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.test_training import ROOT, base_args, latest, losses, pretrain, records

MOE = {
    "--num-experts": "4",
    "--moe-router-topk": "2",
    "--moe-router-score-function": "sigmoid",
    "--moe-router-enable-expert-bias": True,
    "--moe-router-bias-update-rate": "0.01",
    "--moe-aux-loss-coeff": "0.01",
    "--moe-z-loss-coeff": "0.001",
    "--moe-ffn-hidden-size": "48",
    "--moe-layer-freq": "2",
    "--moe-grouped-gemm": True,
    "--use-distributed-optimizer": True,
}


@pytest.mark.parametrize("sharding", ["--use-distributed-optimizer", "--use-megatron-fsdp"])
def test_moe_run_resumes_bit_exactly(dataset_prefix, tokenizer_model, tmp_path, sharding):
    """Under the distributed optimizer and under sharded parameters (the expert bias, a
    parameter without gradient, held whole on every rank and saved once)."""
    moe = {k: v for k, v in MOE.items() if k != "--use-distributed-optimizer"} | {sharding: True}
    ckpt = str(tmp_path / "ckpt")
    found = {}
    for name, extra in (
        ("whole", {}),
        ("first", {"--save": ckpt, "--save-interval": "2", "--exit-interval": "2"}),
        ("resumed", {"--load": ckpt}),
    ):
        log = str(tmp_path / f"{name}.jsonl")
        args = base_args(
            dataset_prefix,
            tokenizer_model,
            **moe,
            **{"--train-iters": "4", "--log-jsonl": log},
            **extra,
        )
        pretrain(2, args)
        found[name] = losses(log)
    assert latest(ckpt) == "2"
    assert sorted(found["resumed"]) == [3, 4]
    for step in (3, 4):
        assert found["resumed"][step] == found["whole"][step], (step, found)
    assert found["first"][2] == found["whole"][2]
    # a GPT-style MoE (learned positions) has no Hugging Face equivalent (Mixtral, Qwen-MoE):
    # refused in one line, nothing written; to Megatron-LM with its dense layers among the MoE
    # ones: megatron-core's per-layer keys, the expert bias among them, and back bit for bit
    from engine.interop.hf.export import export_to_hf
    from engine.interop.megatron.checkpoint import import_from_megatron
    from engine.interop.megatron.common import read_common
    from engine.interop.megatron.export import export_to_megatron
    from engine.interop.megatron.layout import MegatronCheckpoint
    from tests.test_hf import _model_tensors

    with pytest.raises(ConfigError, match="without RoPE has no equivalent in Mixtral, Qwen2"):
        export_to_hf(ckpt, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    export_to_megatron(ckpt, str(tmp_path / "megatron"))
    folder = str(tmp_path / "megatron" / "iter_0000002")
    stored = MegatronCheckpoint(folder).stored
    assert "decoder.layers.0.mlp.router.expert_bias" in stored
    assert "decoder.layers.1.mlp.linear_fc1.weight" in stored  # layer 1 is dense
    assert read_common(folder)["args"].moe_layer_freq == [1, 0, 1, 0]
    import_from_megatron(folder, str(tmp_path / "again"), load_optim=False)
    before = _model_tensors(f"{ckpt}/iter_0000002")
    after = _model_tensors(str(tmp_path / "again" / "iter_0000002"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_expert_parallel_run_resumes_and_reshards(dataset_prefix, tokenizer_model, tmp_path):
    """The experts over 2 expert-parallel ranks (DP 2): a run stopped at its checkpoint and
    resumed gives the same losses, bit for bit; the same checkpoint resumed with every expert
    on each rank (EP 1, under TP 2 with sequence parallelism, each expert whole) and with one
    expert per rank (EP 4 over DP 4) gives the losses of the uninterrupted run within 1e-5
    (another reduction order; no dropout, so no random state is needed across the change of
    layout); and a checkpoint saved under TP 2 x EP 2 (SP, whole experts) resumed under
    TP 1 x EP 4 does too."""
    ckpt, ckpt2 = str(tmp_path / "ckpt"), str(tmp_path / "ckpt-tp2-ep2")
    moe = MOE | {"--hidden-dropout": "0", "--attention-dropout": "0", "--train-iters": "4"}
    found = {}
    for name, world, extra in (
        ("whole", 2, {"--expert-model-parallel-size": "2"}),
        (
            "first",
            2,
            {"--expert-model-parallel-size": "2", "--save": ckpt, "--save-interval": "2"}
            | {"--exit-interval": "2"},
        ),
        ("resumed", 2, {"--expert-model-parallel-size": "2", "--load": ckpt}),
        (
            "tp2-ep1",
            2,
            {"--load": ckpt, "--tensor-model-parallel-size": "2"}
            | {"--sequence-parallel": True, "--expert-tensor-parallel-size": "1"},
        ),
        ("ep4", 4, {"--expert-model-parallel-size": "4", "--load": ckpt}),
        (
            "tp2-ep2-first",
            4,
            {"--tensor-model-parallel-size": "2", "--sequence-parallel": True}
            | {"--expert-model-parallel-size": "2", "--expert-tensor-parallel-size": "1"}
            | {"--save": ckpt2, "--save-interval": "2", "--exit-interval": "2"},
        ),
        ("tp1-ep4", 4, {"--expert-model-parallel-size": "4", "--load": ckpt2}),
    ):
        log = str(tmp_path / f"{name}.jsonl")
        args = base_args(dataset_prefix, tokenizer_model, **moe, **extra, **{"--log-jsonl": log})
        pretrain(world, args)
        found[name] = losses(log)
    assert latest(ckpt) == "2"
    assert found["first"][2] == found["whole"][2]
    assert found["resumed"] == {step: found["whole"][step] for step in (3, 4)}, found
    assert latest(ckpt2) == "2" and sorted(found["tp2-ep2-first"]) == [1, 2]
    for layout in ("tp2-ep1", "ep4", "tp1-ep4"):
        assert sorted(found[layout]) == [3, 4], found
        for step in (3, 4):
            assert abs(found[layout][step] - found["whole"][step]) < 1e-5 * found["whole"][step]


def test_experts_split_over_tensor_parallel_ranks_train_as_whole_ones(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Megatron-LM's default under TP 2: each expert split over the 2 ranks as the dense
    layers (expert tensor parallelism, the grouped GEMM on the shards), the sequence split over
    them; the losses of DP 2 with whole experts within 1e-5."""
    moe = MOE | {"--hidden-dropout": "0", "--attention-dropout": "0", "--train-iters": "3"}
    moe |= {"--disable-bias-linear": True}
    found = {}
    for name, extra in (
        ("dp2", {}),
        ("tp2-etp2", {"--tensor-model-parallel-size": "2", "--sequence-parallel": True}),
    ):
        log = str(tmp_path / f"{name}.jsonl")
        pretrain(
            2, base_args(dataset_prefix, tokenizer_model, **moe, **extra, **{"--log-jsonl": log})
        )
        found[name] = losses(log)
    assert sorted(found["tp2-etp2"]) == [1, 2, 3], found
    for step in (1, 2, 3):
        assert abs(found["tp2-etp2"][step] - found["dp2"][step]) < 1e-5 * found["dp2"][step]


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--moe-router-topk", "4"], "--moe-router-topk is a mixture-of-experts flag: add"),
        (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be between"),
        (
            ["--num-experts", "4", "--moe-layer-freq", "([0]*3+[1]*2)"],
            "gives 5 layers, the model has --num-layers 4",
        ),
        (["--num-experts", "4", "--moe-layer-freq", "([0]*2+[2]*2)"], "must be 0 (dense) or 1"),
        (
            ["--num-experts", "4", "--moe-layer-freq", "[1]*2+__import__('os')"],
            "only list literals",
        ),
        (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], "must be positive"),
        (
            ["--num-experts", "8", "--moe-router-num-groups", "4", "--moe-router-group-topk", "1"]
            + ["--moe-router-topk", "3"],
            "--moe-router-topk 3 is more than the 2 experts",
        ),
        (
            ["--num-experts", "4", "--moe-router-topk", "1"],
            "needs --moe-router-pre-softmax",
        ),
        (
            ["--num-experts", "4", "--tensor-model-parallel-size", "2"],
            "--tensor-model-parallel-size 2 needs --sequence-parallel",
        ),
        (
            ["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            "--expert-tensor-parallel-size 2 (the default: the TP size) with biases: an expert "
            "split over ranks takes no biases here; add --disable-bias-linear",
        ),
        (
            ["--num-experts", "4", "--expert-tensor-parallel-size", "2"]
            + ["--disable-bias-linear", "--moe-ffn-hidden-size", "9"],
            "the experts' hidden size 9 (--moe-ffn-hidden-size) is not divisible by "
            "--expert-tensor-parallel-size 2",
        ),
        (
            ["--num-experts", "6", "--expert-model-parallel-size", "4"],
            "--num-experts 6 is not divisible by --expert-model-parallel-size 4",
        ),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "4"],
            "expert-model-parallel-size 4 does not divide the 2 ranks of a pipeline stage",
        ),
        (["--expert-model-parallel-size", "2"], "need a mixture of experts: add --num-experts"),
    ],
)
def test_bad_moe_flags_are_refused_in_one_line(dataset_prefix, tokenizer_model, extra, problem):
    args = base_args(dataset_prefix, tokenizer_model) + extra
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")) as err:
        prepare(parse(args), 2)
    assert "\n" not in str(err.value)


def test_moe_losses_and_loads_are_logged_the_same_under_any_layout(
    dataset_prefix, tokenizer_model, tmp_path
):
    """The logged MoE losses (megatron-core's names), the expert load and the dropped fraction
    of one process equal those of DP 2 and PP 2 on the same batches (each reduced over the
    ranks that hold their parts)."""
    moe = {
        "--num-experts": "4",
        "--moe-router-topk": "2",
        "--moe-router-load-balancing-type": ["aux_loss", "seq_aux_loss"],
        "--moe-aux-loss-coeff": ["0.01", "0.001"],
        "--moe-z-loss-coeff": "0.001",
        "--moe-expert-capacity-factor": "1.0",
        "--moe-layer-freq": "([1]*2+[0]+[1])",
        "--moe-per-layer-logging": True,
        "--hidden-dropout": "0.0",
        "--attention-dropout": "0.0",
    }
    found = {}
    for name, world, extra in (
        ("one", 1, {}),
        ("dp2", 2, {}),
        ("pp2", 2, {"--pipeline-model-parallel-size": "2"}),
    ):
        log = tmp_path / f"{name}.jsonl"
        args = base_args(
            dataset_prefix,
            tokenizer_model,
            **moe,
            **extra,
            **{"--train-iters": "3", "--log-jsonl": str(log)},
        )
        pretrain(world, args)
        found[name] = [r for r in records(log) if "split" not in r]
    keys = ["load_balancing_loss", "seq_load_balancing_loss", "z_loss", "moe_load_imbalance"]
    keys += ["moe_dropped_fraction", "moe/load_balancing_loss_layer_3"]
    keys += ["moe/load_imbalance_layer_0", "moe/z_loss_layer_1"]
    first = found["one"][0]
    assert 0.5 < first["load_balancing_loss"] < 2.0 and first["moe_load_imbalance"] >= 1.0
    assert 0.0 < first["moe_dropped_fraction"] < 0.5
    assert "moe/z_loss_layer_2" not in first  # layer 2 is dense
    for layout in ("dp2", "pp2"):
        for mine, reference in zip(found[layout], found["one"], strict=True):
            for key in keys:
                assert abs(mine[key] - reference[key]) <= 1e-5 * abs(reference[key]), (
                    layout,
                    key,
                    mine[key],
                    reference[key],
                )
            load, expected = mine["moe_expert_load"], reference["moe_expert_load"]
            assert load.keys() == expected.keys() == {"0", "1", "3"}, load  # the MoE layers
            for layer, shares in expected.items():
                assert abs(sum(shares) / len(shares) - 1.0) < 1e-2  # over the mean
                assert max(abs(a - b) for a, b in zip(load[layer], shares, strict=True)) <= 1e-3
    # the dashboard draws each MoE layer's expert load (and the imbalance over the run)
    png = tmp_path / "dashboard.png"
    command = [sys.executable, "tools/plot_metrics.py", "--log-jsonl", str(tmp_path / "dp2.jsonl")]
    result = subprocess.run(
        command + ["--output", str(png)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0 and png.stat().st_size > 10_000, result.stderr


def test_global_aux_loss_is_the_loss_over_every_data_parallel_rank(
    dataset_prefix, tokenizer_model, tmp_path
):
    """global_aux_loss counts the tokens of all data-parallel ranks: DP 2 with micro-batches
    of 2 logs (and trains on: the losses after the updates) the loss one process computes over
    micro-batches of 4."""
    moe = {
        "--num-experts": "4",
        "--moe-router-load-balancing-type": "global_aux_loss",
        "--moe-aux-loss-coeff": "0.01",
        "--hidden-dropout": "0.0",
        "--attention-dropout": "0.0",
        "--global-batch-size": "4",
        "--train-iters": "3",
        "--lr-warmup-iters": "1",  # (the first update's rate is 0: two updates, one at 3e-3)
    }
    found = {}
    for name, world, micro in (("one", 1, "4"), ("dp2", 2, "2")):
        log = tmp_path / f"{name}.jsonl"
        extra = {"--micro-batch-size": micro, "--log-jsonl": str(log)}
        pretrain(world, base_args(dataset_prefix, tokenizer_model, **moe, **extra))
        found[name] = [r for r in records(log) if "split" not in r]
    for mine, reference in zip(found["dp2"], found["one"], strict=True):
        for key in ("global_load_balancing_loss", "lm_loss"):
            assert abs(mine[key] - reference[key]) <= 1e-5 * reference[key], (key, mine, reference)
    assert 0.7 < found["one"][0]["global_load_balancing_loss"] < 1.5
