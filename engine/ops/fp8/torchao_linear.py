"""--fp8-backend torchao: a linear layer's three FP8 GEMMs through torchao's float8 training
(its casts to Float8TrainingTensor and its scaled-matmul dispatch, with torchao's default
settings: fast accumulation in the forward GEMM, the inner dimension padded where CUDA needs
it), in place of engine/ops/fp8/gemm.py. Where torchao is installed; engine/ops/fp8/linear.py
stays the reference this is tested against.

What stays ours: which tensors are scaled how (the recipe, engine/ops/fp8/recipe.py), the amax
of a tensor-parallel shard reduced over its TP group (torchao reduces over the whole world or
a DTensor mesh), delayed scaling's history (torchao has no delayed scaling any more), and the
scales backward reuses. The scale itself is torchao's (`amax_to_scale`: fp8_max / amax in
fp64, then fp32). Per-tensor recipes only (delayed, tensorwise): torchao's block and MX
formats are prototypes with other layouts. The weight gradient is made in the activations'
dtype, as torchao makes it (ours: in fp32), then handed on in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.config.fp8 import check_torchao
from engine.ops.fp8.linear import Fp8Linear, Fp8Scales
from engine.ops.fp8.quantize import tensor_amax
from parallel.comm import all_reduce


class TorchaoFp8Linear(Fp8Linear):
    """Fp8Linear's forward, input_grad and weight_grad on torchao's Float8TrainingTensor."""

    def __init__(self, recipe, delayed=None, tp_group=None):
        super().__init__(recipe, delayed, tp_group)
        from torchao.float8.float8_training_tensor import (
            GemmInputRole,
            LinearMMConfig,
            ScaledMMConfig,
        )

        self._roles = {
            "input": GemmInputRole.INPUT,
            "weight": GemmInputRole.WEIGHT,
            "grad": GemmInputRole.GRAD_OUTPUT,
        }
        # torchao's defaults (Float8LinearConfig): fast accumulation in the output GEMM only;
        # the inner dimension padded to 16 where CUDA's _scaled_mm needs it
        self._config = LinearMMConfig(
            ScaledMMConfig(False, True, False, True),
            ScaledMMConfig(False, False, False, True),
            ScaledMMConfig(False, False, False, True),
        )

    def _scale(self, x: torch.Tensor, role: str, record: bool) -> torch.Tensor:
        from torchao.float8.float8_utils import amax_to_scale

        dtype = self.recipe.dtype(role)
        if self.delayed is not None:
            if record:
                self.delayed.record(role, x)
            delayed = self.delayed.scale_of(role)
            if delayed is not None:
                return delayed.float().reshape(())
        amax = tensor_amax(x)
        all_reduce(amax, self.tp_group, op=dist.ReduceOp.MAX)
        return amax_to_scale(amax, dtype)

    def _cast(self, x, role: str, scale: torch.Tensor):
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

        scale = scale.float().reshape(())
        return hp_tensor_and_scale_to_float8(
            x, scale, self.recipe.dtype(role), self._config, self._roles[role]
        )

    def forward(self, x, weight, record: bool = True):
        if x.numel() == 0:  # an expert without tokens (torchao's products take none)
            scales = Fp8Scales(torch.ones(1, 1, device=x.device), torch.ones(1, 1, device=x.device))
            return x.new_zeros(0, weight.shape[0]), scales
        scale_x = self._scale(x, "input", record)
        if self.gathered_scale is not None:
            scale_w = self.gathered_scale
        else:
            scale_w = self._scale(weight, "weight", record)
        a, w = self._cast(x, "input", scale_x), self._cast(weight, "weight", scale_w)
        return torch.mm(a, w.t()), Fp8Scales(scale_x.reshape(1, 1), scale_w.reshape(1, 1))

    def input_grad(self, grad_output, weight, scales: Fp8Scales):
        if grad_output.numel() == 0:
            return grad_output.new_zeros(0, weight.shape[1]), None
        scale_g = self._scale(grad_output, "grad", record=True)
        grad = self._cast(grad_output, "grad", scale_g)
        return torch.mm(grad, self._cast(weight, "weight", scales.weight)), grad

    def weight_grad(self, grad_output, x, scales: Fp8Scales, grad=None):
        if grad_output.numel() == 0:
            return torch.zeros(grad_output.shape[1], x.shape[1], device=x.device)
        if grad is None:
            grad = self._cast(grad_output, "grad", self._scale(grad_output, "grad", False))
        return torch.mm(grad.t(), self._cast(x, "input", scales.input)).float()


def torchao_linear(recipe, delayed, tp_group) -> TorchaoFp8Linear:
    check_torchao(recipe.recipe)
    return TorchaoFp8Linear(recipe, delayed, tp_group)
