"""tools/average_checkpoints.py: the last K checkpoints of a TP2 run averaged (uniformly and
with EMA weights) equal the mean of their tensors read one by one; the average loads into
another layout and trains with --finetune; bad requests are one line."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint.average import average_checkpoints, weights_for
from engine.checkpoint.files import iteration_dir
from engine.errors import InputError
from tests.cli import one_line_error, run_tool
from tests.distributed import run_ranks
from tests.test_rerun import MOCK, _train


def _weights(folder: str) -> dict[str, torch.Tensor]:
    from engine.checkpoint.files import read_meta
    from engine.checkpoint.load import load_model_weights
    from engine.config.model import ModelConfig
    from engine.model import BuildContext, GPTModel

    cfg = ModelConfig.from_record(read_meta(folder)["model"])
    model = GPTModel(cfg, BuildContext(cfg))
    load_model_weights(folder, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_average_is_the_mean_of_the_tensors(tmp_path):
    save = str(tmp_path / "run")
    argv = [*MOCK, "--train-iters", "4", "--save", save, "--save-interval", "1"]
    run_ranks(_train, 2, [*argv, "--tensor-model-parallel-size", "2"], {})
    each = [_weights(iteration_dir(save, k)) for k in (2, 3, 4)]

    for name, ema in (("uniform", None), ("ema", 0.5)):
        out = str(tmp_path / name)
        done = average_checkpoints(save, 3, out, ema)
        assert done["iterations"] == [2, 3, 4]
        weights = weights_for(3, ema)
        averaged = _weights(done["checkpoint"])
        for key, value in averaged.items():
            if torch.is_floating_point(value):
                mean = sum(w * t[key].double() for w, t in zip(weights, each, strict=True))
                assert torch.equal(value, mean.to(value.dtype)), key
    assert weights_for(3, 0.5) == pytest.approx([1 / 7, 2 / 7, 4 / 7])

    # the average loads into another layout (one rank here) and trains from its weights
    run_ranks(_train, 1, [*MOCK, "--train-iters", "2", "--load", str(tmp_path / "uniform"),
                          "--finetune"], {})  # fmt: skip

    with pytest.raises(InputError, match="holds 4 complete checkpoint"):
        average_checkpoints(save, 5, str(tmp_path / "too_many"))
    assert one_line_error(
        run_tool("average_checkpoints.py", "--load", save, "--last", "3", "--output",
                 str(tmp_path / "uniform"))
    ).startswith("error: --output ")  # fmt: skip
    assert (
        one_line_error(
            run_tool("average_checkpoints.py", "--load", save, "--last", "1", "--output", "x")
        )
        == "error: --last 1: give at least 2 checkpoints to average"
    )
