"""--log-grad-norms-interval: the gradient norm of each layer and parameter group under
TP2 x PP2 x DP2 with SP and the distributed optimizer equals one process's, and the parts'
squares add up to the global norm's; through the engine, the JSONL carries them (and the
loss variance over the log window)."""

from __future__ import annotations

import math

from engine.monitor.grad_norm_parts import model_part_of
from engine.optim.optimizer import no_weight_decay
from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import engine_run, global_batch, opt_config, reference_grads, tiny_config
from tests.test_training import base_args, pretrain, records


def _reference_part_norms(cfg) -> dict[str, float]:
    from engine.model import BuildContext, GPTModel

    _, grads = reference_grads(cfg, global_batch(0, 8, cfg.seq_length))
    model = GPTModel(cfg, BuildContext(cfg))
    sums: dict[str, float] = {}
    for name, param in model.named_parameters():
        square = grads[name].double().square().sum().item()
        group = "no weight decay" if no_weight_decay(param) else "weight decay"
        for label in (model_part_of(name), f"params: {group}"):
            sums[label] = sums.get(label, 0.0) + square
    return {label: math.sqrt(value) for label, value in sums.items()}


def _engine_part_norms(rank, world, style):
    state = ParallelState.build(tp=2, pp=2)
    cfg = tiny_config(style)
    outputs, _, _ = engine_run(
        state, cfg, opt_config(), 1, 8, 2, zero=True, sequence_parallel=True, part_norms=True
    )
    return outputs[0].part_norms, outputs[0].grad_norm


def test_part_norms_match_one_process_and_add_up_to_the_global_norm():
    for style in ("llama", "gpt2"):  # untied, and tied across pipeline stages
        cfg = tiny_config(style)
        expected = _reference_part_norms(cfg)
        for parts, norm in run_ranks(_engine_part_norms, 8, style):
            assert set(parts) == set(expected)
            for label, value in expected.items():
                assert abs(parts[label] - value) <= 1e-5 * value, (style, label)
            model = sum(v**2 for k, v in parts.items() if not k.startswith("params:"))
            groups = sum(v**2 for k, v in parts.items() if k.startswith("params:"))
            assert abs(math.sqrt(model) - norm) <= 1e-6 * norm
            assert abs(math.sqrt(groups) - norm) <= 1e-6 * norm


def test_the_log_carries_part_norms_and_loss_variance(dataset_prefix, tokenizer_model, tmp_path):
    log = tmp_path / "log.jsonl"
    extra = {"--pipeline-model-parallel-size": "2", "--train-iters": "6", "--log-interval": "3"}
    extra |= {"--log-grad-norms-interval": "2", "--log-jsonl": str(log)}
    pretrain(2, base_args(dataset_prefix, tokenizer_model, **extra))
    train = [r for r in records(log) if "split" not in r]
    assert [r["iteration"] for r in train] == [3, 6]
    for record in train:
        assert record["lm_loss_var"] >= 0.0
        layers = [record[f"grad_norm/layers.{i}"] for i in range(4)]
        assert all(value > 0 for value in layers)
        parts = [v for k, v in record.items() if k.startswith("grad_norm/") and "params:" not in k]
        assert len(parts) == 6  # embedding, 4 layers, final norm (tied: no output layer)
    # the breakdown of iteration 2 is in the window ending at 3, iteration 6's at 6
    assert train[0]["grad_norm/embedding"] != train[1]["grad_norm/embedding"]


def _mtp_part_norms(rank, world):
    state = ParallelState.build(pp=2)
    cfg = tiny_config("llama", mtp_num_layers=1)
    outputs, _, _ = engine_run(state, cfg, opt_config(), 1, 4, 2, zero=True, part_norms=True)
    return outputs[0].part_norms, outputs[0].grad_norm


def test_a_multi_token_prediction_depth_is_a_part_of_its_own():
    for parts, norm in run_ranks(_mtp_part_norms, 2):
        assert parts["mtp.layers.0"] > 0
        model = sum(v**2 for k, v in parts.items() if not k.startswith("params:"))
        assert abs(math.sqrt(model) - norm) <= 1e-6 * norm
