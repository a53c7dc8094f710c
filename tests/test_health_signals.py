"""The health signals the guides name (--log-update-to-weight-ratios, --log-activation-stats,
the train/valid gap): the update ratios equal the change between the checkpoints before and
after the step, the activation statistics are the layers' outputs' RMS and largest magnitude,
the gap is the valid loss minus the training loss, and under TP2 x PP2 x DP2 with sequence
parallelism and the distributed optimizer every number equals one process's within 1e-5."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from engine.checkpoint.files import iteration_dir, read_meta
from engine.monitor.activation_stats import ActivationStats
from engine.monitor.grad_norm_parts import model_part_of
from tests.cli import run_tool
from tests.test_training import base_args, pretrain, records

HEALTH = {"--log-update-to-weight-ratios": True, "--log-activation-stats": True}


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(4, 4), "1": nn.Linear(4, 4)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_activation_statistics_are_the_outputs_rms_and_largest_magnitude():
    torch.manual_seed(0)
    toy = _Toy()
    stats = ActivationStats([toy], 2, torch.device("cpu"))
    inputs = [torch.randn(3, 4), torch.randn(5, 4)]
    toy(inputs[0])  # not armed: not counted
    stats.arm()
    outputs = {0: [], 1: []}
    for x in inputs:
        first = toy.layers["0"](x)
        outputs[0].append(first)
        outputs[1].append(toy.layers["1"](first))
    found = stats.collect(None)
    for n in (0, 1):
        every = torch.cat(outputs[n])
        assert found[f"act_rms/layers.{n}"] == pytest.approx(every.square().mean().sqrt().item())
        assert found[f"act_max/layers.{n}"] == pytest.approx(every.abs().max().item())


def _weights(folder) -> dict[str, torch.Tensor]:
    from engine.checkpoint.load import load_model_weights
    from engine.config.model import ModelConfig
    from engine.model import BuildContext, GPTModel

    cfg = ModelConfig.from_record(read_meta(folder)["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(folder, model)
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def test_update_ratios_are_the_steps_change_and_the_gap_is_valid_minus_train(
    dataset_prefix, tokenizer_model, tmp_path
):
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = base_args(
        dataset_prefix, tokenizer_model,
        **{"--train-iters": "3", "--save": str(save), "--save-interval": "1",
           "--eval-interval": "2", "--log-jsonl": str(log), **HEALTH},
    )  # fmt: skip
    assert pretrain(1, args) == [0]
    logged = records(log)
    train = {r["iteration"]: r for r in logged if "split" not in r}
    before, after = _weights(iteration_dir(str(save), 1)), _weights(iteration_dir(str(save), 2))
    parts: dict[str, list[float]] = {}
    for name, weight in after.items():
        part = parts.setdefault(model_part_of(name), [0.0, 0.0])
        part[0] += (weight - before[name]).square().sum().item()
        part[1] += weight.square().sum().item()
    assert len(parts) >= 5  # embedding, 4 layers, final norm
    for part, (step, size) in parts.items():
        assert train[2][f"update_ratio/{part}"] == pytest.approx(math.sqrt(step / size), rel=1e-6)
    squares, count = sum(step for step, _ in parts.values()), sum(w.numel() for w in after.values())
    assert train[2]["update_rms/adam"] == pytest.approx(math.sqrt(squares / count), rel=1e-6)
    for n in range(4):
        assert train[2][f"act_max/layers.{n}"] >= train[2][f"act_rms/layers.{n}"] > 0
    valid = [r for r in logged if r.get("split") == "valid"]
    assert [r["iteration"] for r in valid] == [2, 3]
    for record in valid:
        expected = record["lm_loss"] - train[record["iteration"]]["lm_loss"]
        assert record["train_valid_gap"] == pytest.approx(expected, abs=1e-12)

    png = tmp_path / "health.png"  # the dashboard's health panels
    result = run_tool("plot_metrics.py", "--log-jsonl", str(log), "--output", str(png))
    assert result.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", result.stderr


def test_health_signals_are_one_process_under_tp_pp_dp_sp_and_sharding(
    dataset_prefix, tokenizer_model, tmp_path
):
    common = {"--train-iters": "3", "--hidden-dropout": "0.0", "--attention-dropout": "0.0",
              **HEALTH}  # fmt: skip
    found = {}
    for world, layout in ((1, {}), (8, {"--tensor-model-parallel-size": "2",
                                         "--pipeline-model-parallel-size": "2",
                                         "--sequence-parallel": True,
                                         "--use-distributed-optimizer": True})):  # fmt: skip
        log = tmp_path / f"log{world}.jsonl"
        args = base_args(dataset_prefix, tokenizer_model,
                         **{**common, **layout, "--log-jsonl": str(log)})  # fmt: skip
        assert pretrain(world, args) == [0] * world
        found[world] = [r for r in records(log) if "split" not in r]
    for one, eight in zip(found[1], found[8], strict=True):
        keys = [k for k in one if k.startswith(("update_ratio/", "update_rms/", "act_"))]
        assert len(keys) >= 15 and set(keys) <= set(eight)
        for key in keys:
            assert eight[key] == pytest.approx(one[key], rel=1e-5), key
