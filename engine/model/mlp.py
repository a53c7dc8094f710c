"""The feed-forward block: column-parallel up projection, GELU or SwiGLU, row-parallel down."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.context import BuildContext
from parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int):
        super().__init__()
        cfg = ctx.config
        f = cfg.ffn_size
        self.swiglu = cfg.swiglu
        self.ops = ctx.ops
        self.gelu_approximation = "tanh" if cfg.openai_gelu else "none"
        prefix = f"layers.{layer_number}.mlp"
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            2 * f if cfg.swiglu else f,
            tp_group=ctx.tp_group,
            init_method=ctx.init_method,
            init_seed=ctx.param_seed(f"{prefix}.linear_fc1.weight"),
            bias=cfg.add_bias_linear,
            sequence_parallel=ctx.sequence_parallel,
            partition_sizes=[f, f] if cfg.swiglu else None,
            partition_names=[".gate", ".up"] if cfg.swiglu else None,
            gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
            times=ctx.times,
        )
        self.linear_fc2 = RowParallelLinear(
            f,
            cfg.hidden_size,
            tp_group=ctx.tp_group,
            init_method=ctx.output_init_method,
            init_seed=ctx.param_seed(f"{prefix}.linear_fc2.weight"),
            bias=cfg.add_bias_linear,
            sequence_parallel=ctx.sequence_parallel,
            gradient_accumulation_fusion=ctx.gradient_accumulation_fusion,
            params_dtype=ctx.params_dtype,
            device=ctx.device,
            times=ctx.times,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            h = self.ops.swiglu(h)
        else:
            h = F.gelu(h, approximate=self.gelu_approximation)
        return self.linear_fc2(h)
