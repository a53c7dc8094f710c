"""--log-num-zeros-in-grad and --log-params-norm (Megatron-LM's meanings): under TP2 x PP2 x
DP2 with SP and the distributed optimizer, the gradient's zero elements and the parameters'
norm after the update count every element once, as one process counts them; through the
engine, the log line and the JSONL carry them."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import (
    engine_run,
    full_params,
    global_batch,
    opt_config,
    reference_grads,
    tiny_config,
)
from tests.test_training import base_args, pretrain, records


def _config(style):
    # without biases: a key bias's exact gradient is zero (softmax ignores a shift shared by
    # all keys), computed as rounding noise that is exactly zero in one summation order and
    # not in another
    return tiny_config(style, add_bias_linear=False)


def _engine_counts(rank, world, style):
    state = ParallelState.build(tp=2, pp=2)
    cfg = _config(style)
    outputs, ddps, _ = engine_run(
        state, cfg, opt_config(), 1, 8, 2, zero=True, sequence_parallel=True, counts=True
    )
    shapes = {n: p.numel() for n, p in full_params(ddps, state).items()}
    after = full_params(ddps, state)
    squares = {n: p.double().square().sum().item() for n, p in after.items()}
    return outputs[0].num_zeros, outputs[0].params_norm, shapes, squares


def test_zeros_and_params_norm_count_every_element_once():
    for style in ("llama", "gpt2"):  # untied, and tied across pipeline stages
        cfg = _config(style)
        _, grads = reference_grads(cfg, global_batch(0, 8, cfg.seq_length))
        results = run_ranks(_engine_counts, 8, style)
        shapes, squares = {}, {}
        for _, _, rank_shapes, rank_squares in results:
            shapes |= rank_shapes
            squares |= rank_squares
        # the vocabulary is padded further at TP 2: its extra rows have zero gradients
        padding = sum(shapes[n] - g.numel() for n, g in grads.items())
        zeros = sum((g == 0).sum().item() for g in grads.values()) + padding
        assert zeros > padding  # rows of tokens absent from the batch, besides the padding
        norm = math.sqrt(sum(squares.values()))
        for num_zeros, params_norm, _, _ in results:
            assert num_zeros == zeros, (style, num_zeros, zeros)
            assert abs(params_norm - norm) <= 1e-6 * norm, (style, params_norm, norm)


def test_the_log_carries_zeros_and_params_norm(dataset_prefix, tokenizer_model, tmp_path, capfd):
    log = tmp_path / "log.jsonl"
    extra = {"--train-iters": "4", "--log-interval": "2", "--log-jsonl": str(log)}
    args = base_args(dataset_prefix, tokenizer_model, **extra)
    pretrain(2, args + ["--log-params-norm", "--log-num-zeros-in-grad"])
    train = [r for r in records(log) if "split" not in r]
    assert [r["iteration"] for r in train] == [2, 4]
    assert all(r["num_zeros"] >= 0 and r["params_norm"] > 0 for r in train)
    assert train[0]["params_norm"] != train[1]["params_norm"]
    out = capfd.readouterr().out
    assert out.count("| num zeros ") == 2 and out.count("| params norm ") == 2


def test_tensorboard_log_interval(dataset_prefix, tokenizer_model, tmp_path):
    """Megatron-LM's meaning: the per-iteration scalars every --tensorboard-log-interval
    iterations (each iteration's own value); the window's rates with the log line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    extra = {"--train-iters": "6", "--log-interval": "3", "--tensorboard-dir": str(tb)}
    args = base_args(dataset_prefix, tokenizer_model, **extra)
    pretrain(1, args + ["--tensorboard-log-interval", "2", "--tensorboard-queue-size", "5"])
    events = EventAccumulator(str(tb))
    events.Reload()
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size"):
        assert [e.step for e in events.Scalars(tag)] == [2, 4, 6], tag
    assert [e.step for e in events.Scalars("throughput")] == [3, 6]


def test_memory_tags_are_megatron_lms_and_absent_on_a_cpu():
    from engine.monitor.metrics import cuda_memory_tags, tensorboard_scalars

    assert cuda_memory_tags(torch.device("cpu")) == {}
    record = {"iteration": 1, "mem-allocated-bytes": 10, "mem-reserved-bytes": 20}
    tags = {tag for tag, _, _ in tensorboard_scalars(record)}
    assert tags == {"mem-allocated-bytes", "mem-reserved-bytes"}  # Megatron-LM's tags


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_memory_tags_read_the_cuda_allocator():
    from engine.monitor.metrics import cuda_memory_tags

    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(1 << 20, device=device)
    tags = cuda_memory_tags(device)
    assert tags["mem-allocated-bytes"] >= held.numel() * 4
    assert tags["mem-max-allocated-bytes"] >= tags["mem-allocated-bytes"]
    assert tags["mem-reserved-bytes"] >= tags["mem-allocated-bytes"]
    assert tags["mem-allocated-count"] >= 1
