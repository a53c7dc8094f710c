"""--log-gradient-noise-scale: each DP rank's own squared gradient norm (read from the DDP
buckets before their reduction) and the reduced one equal one process's gradients over the
same samples, under TP2 x DP2 (with SP, ZeRO and overlapped reductions) and PP2 x DP2 with
tied embeddings; the estimator recovers a known noise scale; the engine logs it; layouts that
cannot give it are refused in one line."""

from __future__ import annotations

import pytest
import torch

from engine.monitor.noise_scale import NoiseScale
from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import (
    engine_run,
    global_batch,
    micro_batches,
    opt_config,
    reference_grads,
    tiny_config,
)
from tests.test_training import base_args, pretrain, records

GBS, MBS, DP = 8, 2, 2


def _squares(grads: dict) -> float:
    return sum(g.double().square().sum().item() for g in grads.values())


def _reference(cfg) -> tuple[float, float]:
    """(mean over DP ranks of |own gradient|^2, |whole batch's gradient|^2)."""
    tokens = global_batch(0, GBS, cfg.seq_length)
    _, whole = reference_grads(cfg, tokens)
    own = []
    for rank in range(DP):
        mine = torch.cat([b["tokens"] for b in micro_batches(tokens, MBS, rank, DP)])
        labels = torch.cat([b["labels"] for b in micro_batches(tokens, MBS, rank, DP)])
        _, grads = reference_grads(cfg, torch.cat([mine, labels[:, -1:]], dim=1))
        own.append(_squares(grads))
    return sum(own) / DP, _squares(whole)


def _engine(rank, world, tp, pp, style):
    state = ParallelState.build(tp=tp, pp=pp)
    options = dict(zero=True, sequence_parallel=True, overlap=True) if tp > 1 else {}
    outputs, _, _ = engine_run(
        state, tiny_config(style), opt_config(), 1, GBS, MBS, local_squares=True, **options
    )
    return outputs[0].local_grad_squares, outputs[0].grad_norm


@pytest.mark.parametrize("tp, pp, style", [(2, 1, "llama"), (1, 2, "gpt2")])
def test_own_and_reduced_gradient_norms_match_one_process(tp, pp, style):
    own, whole = _reference(tiny_config(style))
    for got_own, norm in run_ranks(_engine, 4, tp, pp, style):
        assert abs(got_own - own) <= 1e-5 * own
        assert abs(norm**2 - whole) <= 1e-5 * whole
        assert own > whole  # a half batch's gradient is noisier


def test_estimator_recovers_a_known_noise_scale():
    """Gradients drawn as G + noise / sqrt(B): B_simple = tr(cov) / |G|^2."""
    generator = torch.Generator().manual_seed(0)
    true = torch.randn(2000, generator=generator, dtype=torch.float64)
    std = 3.0
    scale = NoiseScale(decay=0.99)
    for _ in range(400):
        per_rank = [true + std * torch.randn(2000, generator=generator, dtype=torch.float64) / 4.0
                    for _ in range(4)]  # fmt: skip
        whole = torch.stack(per_rank).mean(0)
        small = sum(g.square().sum().item() for g in per_rank) / 4
        estimate = scale.update(small, 16, whole.square().sum().item(), 64)
    expected = std**2 * 2000 / true.square().sum().item()
    assert abs(estimate - expected) < 0.1 * expected


def test_the_logged_noise_scale_follows_its_formula_on_the_logged_norms(
    dataset_prefix, tokenizer_model, tmp_path
):
    """Every iteration logged: the noise scale is the smoothed estimate the module docstring's
    formula gives from the logged norms (the reduced gradient's and the DP ranks' own)."""
    log = tmp_path / "log.jsonl"
    extra = {"--train-iters": "4", "--log-interval": "1", "--log-gradient-noise-scale": True}
    pretrain(2, base_args(dataset_prefix, tokenizer_model, **extra, **{"--log-jsonl": str(log)}))
    train = [r for r in records(log) if "split" not in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    big_batch = train[0]["batch_size"]
    small_batch = big_batch // 2  # each of the 2 data-parallel ranks' share
    g2 = trace = None  # McCandlish et al.'s estimates, written out; moving averages of 0.95
    for r in train:
        small, big = r["local_grad_norm"] ** 2, r["grad_norm"] ** 2
        assert small > big > 0  # a smaller batch: a noisier gradient
        step_g2 = (big_batch * big - small_batch * small) / (big_batch - small_batch)
        step_trace = (small - big) / (1 / small_batch - 1 / big_batch)
        g2 = step_g2 if g2 is None else 0.95 * g2 + 0.05 * step_g2
        trace = step_trace if trace is None else 0.95 * trace + 0.05 * step_trace
        expected = trace / g2 if g2 > 0 else float("nan")
        assert r["gradient_noise_scale"] == pytest.approx(expected, rel=1e-9, nan_ok=True), r


@pytest.mark.parametrize(
    "world, extra, message",
    [
        (1, [], "--log-gradient-noise-scale compares each data-parallel rank's gradient"),
        (4, ["--context-parallel-size", "2"], "--log-gradient-noise-scale is not available wit"),
        (2, ["--use-megatron-fsdp"], "--log-gradient-noise-scale is not available with --data"),
    ],
)
def test_layouts_without_a_noise_scale_are_refused(world, extra, message):
    from engine.errors import ConfigError
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    argv = [
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2"),
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
        *("--train-iters", "4", "--attention-dropout", "0.0", "--log-gradient-noise-scale"),
    ]
    with pytest.raises(ConfigError) as error:
        prepare(parse(argv + extra), world)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
