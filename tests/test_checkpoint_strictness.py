"""--dist-ckpt-strictness: what a resume does with tensors only the model or only the checkpoint
has, with megatron-core's StrictHandling meanings ("unexpected": the model's, absent from the
checkpoint; "missing": the checkpoint's, absent from the model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.checkpoint.load import check_shapes
from engine.config.checkpointing import STRICTNESS, CheckpointConfig
from engine.errors import CheckpointError, ConfigError
from tests.test_training import base_args, pretrain

MODEL = {"model/a": (2, 3), "model/b": (4,)}


def _stored(shapes: dict):
    entries = {k: SimpleNamespace(size=v) for k, v in shapes.items()}
    return SimpleNamespace(state_dict_metadata=entries)


def _state(shapes: dict):
    return {k: SimpleNamespace(global_shape=v) for k, v in shapes.items()}


# (stops on the model's extra tensor, stops on the checkpoint's extra tensor)
STOPS = {
    "assume_ok_unexpected": (True, False),
    "log_unexpected": (False, False),
    "log_all": (False, False),
    "raise_unexpected": (True, False),
    "raise_all": (True, True),
    "ignore_all": (False, False),
}


@pytest.mark.parametrize("strictness", STOPS)
def test_each_strictness_stops_or_skips_as_megatron_core(strictness):
    stops_unexpected, stops_missing = STOPS[strictness]
    model_extra = dict(MODEL, **{"model/c": (5,)})
    if stops_unexpected:
        with pytest.raises(CheckpointError, match="it has no tensor c, which this model needs"):
            check_shapes("ckpt", _stored(MODEL), _state(model_extra), strictness=strictness)
    else:
        found = check_shapes("ckpt", _stored(MODEL), _state(model_extra), strictness=strictness)
        assert found == (["c"], [])
    checkpoint_extra = dict(MODEL, **{"model/d": (6,)})
    if stops_missing:
        with pytest.raises(CheckpointError, match="its tensor d does not exist in this model"):
            check_shapes("ckpt", _stored(checkpoint_extra), _state(MODEL), strictness=strictness)
    else:
        found = check_shapes(
            "ckpt", _stored(checkpoint_extra), _state(MODEL), strictness=strictness
        )
        assert found == ([], ["d"])
    # a shape that differs stops every mode
    wrong = dict(MODEL, **{"model/b": (5,)})
    with pytest.raises(CheckpointError, match="tensor b has shape"):
        check_shapes("ckpt", _stored(wrong), _state(MODEL), strictness=strictness)


def test_the_returning_modes_are_refused_in_one_line():
    assert set(STOPS) | {"return_unexpected", "return_all"} == set(STRICTNESS)
    for mode in ("return_unexpected", "return_all"):
        with pytest.raises(ConfigError, match="a training run does not have"):
            CheckpointConfig(dist_ckpt_strictness=mode).validate()


def test_resume_keeps_or_skips_tensors_through_a_run(
    dataset_prefix, tokenizer_model, tmp_path, capfd
):
    """A checkpoint without biases resumed by a model with them, and the other way round."""
    run = {"--train-iters": "4", "--exit-interval": "2", "--save-interval": "2"}
    plain, biased = tmp_path / "plain", tmp_path / "biased"
    pretrain(
        1,
        base_args(dataset_prefix, tokenizer_model, **run, **{"--save": str(plain)})
        + ["--disable-bias-linear"],
    )
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **run, **{"--save": str(biased)}))
    capfd.readouterr()
    resume = {"--train-iters": "4", "--log-interval": "2"}
    # the model's biases are not in the checkpoint: they start from their initial zeros
    with pytest.raises(AssertionError, match="it has no tensor .*bias, which this model needs"):
        pretrain(1, base_args(dataset_prefix, tokenizer_model, **resume, **{"--load": str(plain)}))
    strict = {"--load": str(plain), "--dist-ckpt-strictness": "log_unexpected"}
    pretrain(1, base_args(dataset_prefix, tokenizer_model, **resume, **strict))
    out = capfd.readouterr().out
    assert "unexpected tensors, this model's, not in the checkpoint" in out
    assert "iteration      4/4" in out
    # the checkpoint's biases are not in the model: skipped, named with log_all
    unbiased = base_args(dataset_prefix, tokenizer_model, **resume, **{"--load": str(biased)})
    pretrain(1, unbiased + ["--disable-bias-linear", "--dist-ckpt-strictness", "log_all"])
    out = capfd.readouterr().out
    assert "missing tensors, the checkpoint's, not in this model (not read)" in out
    with pytest.raises(AssertionError, match="does not exist in this model"):
        pretrain(1, unbiased + ["--disable-bias-linear", "--dist-ckpt-strictness", "raise_all"])
