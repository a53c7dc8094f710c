"""Gradient interference and surgery between a blend's datasets
(engine/train/dataset_gradients.py): the datasets' losses add up to the step's; the cosines agree
with the step's own gradient norm (|g|^2 = |a|^2 + |b|^2 + 2|a||b|cos); the extra passes leave
the run as it was; PCGrad is Yu et al.'s algorithm; and under TP2 x PP2 x DP2 with sequence
parallelism and the distributed optimizer every number equals one process's within 1e-5. The
blend is the test corpus and uniformly random tokens, whose gradients conflict."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.train.dataset_gradients import surgery
from engine.train.loss import make_loss_func
from tests.cli import one_line_error, run_python, run_tool
from tests.test_training import base_args, pretrain, records


@pytest.fixture(scope="module")
def noise_prefix(tokenizer_model, tmp_path_factory) -> str:
    """An indexed dataset of uniformly random tokens in the test tokenizer's vocabulary, as
    tools/make_random_tokens.py writes it."""
    prefix = str(tmp_path_factory.mktemp("noise") / "noise_text_document")
    result = run_tool("make_random_tokens.py", "--tokenizer-model", tokenizer_model,
                      "--output-prefix", prefix, "--documents", "300")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return prefix


def test_the_datasets_losses_add_up_to_the_steps():
    generator = torch.Generator().manual_seed(0)
    per_token = torch.rand(4, 6, generator=generator, requires_grad=True)
    domain = torch.tensor([0, 1, 0, 2])
    mask = (torch.rand(4, 6, generator=generator) > 0.3).float()
    for batch in ({"domain": domain}, {"domain": domain, "loss_mask": mask}):
        for per_token_loss in (False, True):
            count = torch.tensor(7.5)
            made = [
                make_loss_func(2, 4.0, token_count=count, per_token=per_token_loss,
                               only_domain=d)(per_token, batch)[0]
                for d in (None, 0, 1, 2)
            ]  # fmt: skip
            assert torch.allclose(made[0], sum(made[1:]), rtol=1e-6)


def _reference_surgery(grads: list[np.ndarray], orders: list[list[int]]):
    """Yu et al.'s PCGrad, as the paper's algorithm 1 writes it, in numpy."""
    out = np.zeros_like(grads[0])
    for i, order in enumerate(orders):
        g = grads[i].copy()
        for j in order:
            if j != i and g @ grads[j] < 0:
                g = g - (g @ grads[j]) / (grads[j] @ grads[j]) * grads[j]
        out += g
    return out


def test_surgery_is_yu_et_als_algorithm():
    rng = np.random.default_rng(3)
    vectors = [rng.normal(size=10) for _ in range(3)]
    vectors[1] = -0.8 * vectors[0] + 0.3 * vectors[1]  # conflicts with 0
    grads = [[torch.tensor(v[:4]), torch.tensor(v[4:])] for v in vectors]

    def dot(a, b):
        return sum(float(x @ y) for x, y in zip(a, b, strict=True))

    combined, projections = surgery(grads, dot, torch.Generator().manual_seed(5))
    replay = torch.Generator().manual_seed(5)
    orders = [torch.randperm(3, generator=replay).tolist() for _ in range(3)]
    expected = _reference_surgery(vectors, orders)
    assert np.allclose(torch.cat(combined).numpy(), expected, rtol=1e-12)
    assert projections >= 2
    # no conflict, no change: the sum of the gradients
    same = [[torch.tensor(v[:4]).abs(), torch.tensor(v[4:]).abs()] for v in vectors]
    combined, projections = surgery(same, dot, torch.Generator().manual_seed(5))
    assert projections == 0
    assert np.allclose(torch.cat(combined).numpy(), sum(np.abs(v) for v in vectors))


def _run(world, dataset_prefix, noise_prefix, tokenizer_model, log, **flags):
    blend = ["0.5", f"web:{dataset_prefix}", "0.5", f"noise:{noise_prefix}"]
    args = base_args(
        blend, tokenizer_model,
        **{"--train-iters": "4", "--global-batch-size": "8", "--log-jsonl": str(log),
           "--clip-grad": "0", "--lr": "3e-3", **flags},
    )  # fmt: skip
    assert pretrain(world, args) == [0] * world
    return [r for r in records(log) if "split" not in r]


def test_cosines_agree_with_the_steps_gradient_and_leave_the_run_as_it_was(
    dataset_prefix, noise_prefix, tokenizer_model, tmp_path
):
    paths = (dataset_prefix, noise_prefix, tokenizer_model)
    plain = _run(1, *paths, tmp_path / "plain.jsonl")  # dropout on: the passes restore RNG
    measured = _run(1, *paths, tmp_path / "cos.jsonl", **{"--log-gradient-cosine-interval": "1"})
    assert [r["lm_loss"] for r in measured] == [r["lm_loss"] for r in plain]
    assert [r["grad_norm"] for r in measured] == [r["grad_norm"] for r in plain]
    for r in measured:
        a, b = r["grad_norm_dataset/web"], r["grad_norm_dataset/noise"]
        cos = r["grad_cosine/web|noise"]
        assert math.isclose(r["grad_norm"] ** 2, a * a + b * b + 2 * a * b * cos, rel_tol=1e-5)
        assert {f"grad_cosine/web|noise/layers.{i}" for i in range(4)} <= r.keys()
        assert "time/dataset-gradients" in r
    png = tmp_path / "interference.png"  # the dashboard's interference panels
    result = run_tool("plot_metrics.py", "--log-jsonl", str(tmp_path / "cos.jsonl"),
                      "--output", str(png))  # fmt: skip
    assert result.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", result.stderr

    surgery_run = _run(1, *paths, tmp_path / "pc.jsonl",
                       **{"--log-gradient-cosine-interval": "1", "--pcgrad": True})  # fmt: skip
    assert sum(r["pcgrad_projections"] for r in surgery_run) > 0
    for r in surgery_run:  # the update's norm is that of the projected gradients' sum
        a, b = r["grad_norm_dataset/web"], r["grad_norm_dataset/noise"]
        p = a * b * r["grad_cosine/web|noise"]
        if r["pcgrad_projections"]:
            assert r["pcgrad_projections"] == 2 and p < 0
            x, y = 1 - p / (a * a), 1 - p / (b * b)
            expected = a * a * x * x + b * b * y * y + 2 * p * x * y
        else:
            expected = a * a + b * b + 2 * p
        assert math.isclose(r["grad_norm"] ** 2, expected, rel_tol=1e-5)


@pytest.mark.parametrize(
    "world, layout",
    [
        (8, {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "2",
             "--sequence-parallel": True, "--use-distributed-optimizer": True}),
        (4, {"--context-parallel-size": "2", "--use-megatron-fsdp": True,
             "--data-parallel-sharding-strategy": "optim_grads_params"}),
    ],
    ids=["tp2-pp2-dp2-sp-distopt", "cp2-dp2-fsdp-params"],
)  # fmt: skip
def test_cosines_and_pcgrad_are_one_process_under_every_layout(
    dataset_prefix, noise_prefix, tokenizer_model, tmp_path, world, layout
):
    paths = (dataset_prefix, noise_prefix, tokenizer_model)
    flags = {"--log-gradient-cosine-interval": "1", "--pcgrad": True, "--train-iters": "3",
             "--hidden-dropout": "0.0", "--attention-dropout": "0.0"}  # fmt: skip
    one = _run(1, *paths, tmp_path / "one.jsonl", **flags)
    eight = _run(world, *paths, tmp_path / "layout.jsonl", **flags, **layout)
    assert sum(r["pcgrad_projections"] for r in one) > 0
    for a, b in zip(one, eight, strict=True):
        prefixes = ("grad_cosine/", "grad_norm_dataset/")
        keys = [k for k in a if k.startswith(prefixes)]
        assert len(keys) > 8 and set(keys) == {k for k in b if k.startswith(prefixes)}
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key
        for key in ("lm_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        assert a["pcgrad_projections"] == b["pcgrad_projections"]


def test_gradient_cosines_without_a_blend_is_one_line(dataset_prefix, tokenizer_model):
    args = base_args(dataset_prefix, tokenizer_model, **{"--log-gradient-cosine-interval": "1"})
    result = run_python("-m", "engine.pretrain", *args)
    assert "compares the gradients of the training blend's datasets" in one_line_error(result)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pcgrad", "--rerun-on-nan"], "--pcgrad with --rerun-on-nan"),
        (["--log-gradient-cosine-interval", "1", "--num-experts", "2"], "not with a mixture"),
    ],
)
def test_combinations_not_built_yet_are_one_line(flags, message):
    from engine.errors import ConfigError
    from engine.pretrain import parse
    from engine.train.preflight import prepare
    from tests.test_rerun import MOCK

    with pytest.raises(ConfigError, match=message):
        prepare(parse([*MOCK, *flags]), 1)
