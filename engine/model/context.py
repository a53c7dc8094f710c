"""What every layer of the model is built with, passed down explicitly (no globals)."""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.ops.torch_ops import TorchOps
from parallel.random import RNGStatesTracker
from parallel.tensor import normal_init, scaled_normal_init


@dataclass
class BuildContext:
    """Model config plus the parallel facts a layer needs to build and run itself."""

    config: ModelConfig
    tp_group: object = None
    tp_size: int = 1
    sequence_parallel: bool = False
    gradient_accumulation_fusion: bool = True  # weight gradients straight into main_grad
    tracker: RNGStatesTracker | None = None
    params_dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    seed: int = 1234
    ops: object = field(default_factory=TorchOps)  # TorchOps or engine.ops.fused.FusedOps

    def param_seed(self, name: str) -> int:
        """Initialisation seed of the parameter with this global name: the same on every rank
        and for every layout, so TP and PP sizes never change the initial model."""
        return (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)

    @property
    def init_method(self):
        return normal_init(self.config.init_method_std)

    @property
    def output_init_method(self):
        return scaled_normal_init(self.config.init_method_std, self.config.num_layers)

    def dropout_stream(self):
        """RNG context for dropout on [s, b, h] activations between TP blocks: the per-rank
        stream when they are sequence-split, else the default stream shared by the TP group."""
        if self.sequence_parallel and self.tracker is not None:
            return self.tracker.fork()
        return contextlib.nullcontext()
