"""Megatron-LM flags that change the model's function, checked against megatron-core's own:
--squared-relu (megatron.core.activations.squared_relu)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.model import BuildContext, GPTModel
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.harness import tiny_config
from tests.test_megatron_flags import SHAPE


def test_squared_relu_is_megatron_cores():
    activations = pytest.importorskip("megatron.core.activations")
    cfg = tiny_config("gpt2", squared_relu=True)
    mlp = GPTModel(cfg, BuildContext(cfg)).layers["0"].mlp
    x = torch.randn(5, 2, cfg.hidden_size)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    hidden = torch.nn.functional.linear(x, fc1.weight, fc1.bias)
    expected = torch.nn.functional.linear(activations.squared_relu(hidden), fc2.weight, fc2.bias)
    assert torch.equal(mlp(x), expected)
    plain = tiny_config("gpt2")
    gelu = GPTModel(plain, BuildContext(plain)).layers["0"].mlp
    assert not torch.equal(gelu(x), expected)  # the flag changes the function


def test_squared_relu_is_refused_beside_swiglu():
    prepare(parse(SHAPE + ["--squared-relu"]), 1)
    with pytest.raises(ConfigError, match="--squared-relu replaces GELU: drop --swiglu"):
        prepare(parse(SHAPE + ["--squared-relu", "--swiglu"]), 1)


def test_distributed_backend_is_checked_against_the_device():
    on_cpu = SHAPE + ["--device", "cpu"]
    prepare(parse(on_cpu + ["--distributed-backend", "gloo"]), 1)
    with pytest.raises(ConfigError, match="--distributed-backend nccl needs CUDA GPUs"):
        prepare(parse(on_cpu + ["--distributed-backend", "nccl"]), 1)
