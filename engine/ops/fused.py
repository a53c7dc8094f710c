"""Autograd functions over the fused kernels, and building them.

`FusedOps(kernels)` has the same methods as TorchOps. `kernels` is the compiled `tripod_fused`
module (csrc/fused, built by setup.py or on first use with torch.utils.cpp_extension.load and
cached per torch version and GPU architecture) or, for tests on CPU, the PyTorch
implementation of the same interface in reference_kernels.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from engine.ops.outside_graphs import outside_compiled_graphs
from engine.ops.torch_ops import rotary as torch_rotary
from parallel.comm import all_reduce, group_rank
from parallel.tensor_parallel.regions import measure_tp_comm

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "fused"
SOURCES = ["bindings.cpp", "norms.cu", "rope.cu", "swiglu.cu", "cross_entropy.cu"]


def _stream(x: torch.Tensor) -> int:
    return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, kernels):
        x2 = x.contiguous()
        y, rstd = kernels.rms_norm_fwd(x2, weight.contiguous(), eps, _stream(x))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.kernels.rms_norm_bwd(dy.contiguous(), x, weight.contiguous(), rstd, _stream(x))
        return dx, dw, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, kernels):
        x2 = x.contiguous()
        y, mean, rstd = kernels.layer_norm_fwd(
            x2, weight.contiguous(), bias.contiguous(), eps, _stream(x)
        )
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = ctx.kernels.layer_norm_bwd(
            dy.contiguous(), x, weight.contiguous(), mean, rstd, _stream(x)
        )
        return dx, dw, db, None, None


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, kernels):
        table = (cos.shape[0], cos.shape[-1])
        cos2 = cos.reshape(table).float().contiguous()
        sin2 = sin.reshape(table).float().contiguous()
        ctx.save_for_backward(cos2, sin2)
        ctx.kernels = kernels
        return kernels.rotary(x.contiguous(), cos2, sin2, False, _stream(x))

    @staticmethod
    def backward(ctx, dy):
        cos2, sin2 = ctx.saved_tensors
        return ctx.kernels.rotary(dy.contiguous(), cos2, sin2, True, _stream(dy)), None, None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, kernels):
        h2 = h.contiguous()
        ctx.save_for_backward(h2)
        ctx.kernels = kernels
        return kernels.swiglu_fwd(h2, _stream(h))

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        return ctx.kernels.swiglu_bwd(dy.contiguous(), h, _stream(h)), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """As parallel.tensor_parallel.layers's, with the per-row work in kernels: only [rows]
    statistics are made (max, sum of exp, target logit), never a softmax of the logits' size."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, kernels, times):
        shape = target.shape
        rows = logits.reshape(-1, logits.shape[-1]).contiguous()
        flat_target = target.reshape(-1).contiguous()
        stream = _stream(logits)
        row_max = kernels.ce_max(rows, vocab_start, vocab_size, stream)
        with measure_tp_comm(times, group):
            all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        sum_exp, predicted = kernels.ce_stats(
            rows, row_max, flat_target, vocab_start, vocab_size, stream
        )
        stats = torch.stack([sum_exp, predicted])
        with measure_tp_comm(times, group):
            all_reduce(stats, group)
        sum_exp, predicted = stats[0].contiguous(), stats[1]
        log_sum_exp = torch.log(sum_exp)
        ctx.save_for_backward(rows, row_max, sum_exp, flat_target)
        ctx.meta = (kernels, vocab_start, vocab_size, logits.shape)
        return (log_sum_exp - predicted).view(shape), (log_sum_exp + row_max).view(shape)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        rows, row_max, sum_exp, target = ctx.saved_tensors
        kernels, vocab_start, vocab_size, shape = ctx.meta
        grad = kernels.ce_bwd(
            rows,
            row_max,
            sum_exp,
            target,
            grad_loss.reshape(-1).float().contiguous(),
            grad_lse.reshape(-1).float().contiguous(),
            vocab_start,
            vocab_size,
            _stream(rows),
        )
        return grad.view(shape), None, None, None, None, None, None


class FusedOps:
    """The fused-kernel op set; same methods as engine.ops.torch_ops.TorchOps."""

    name = "fused CUDA kernels (csrc/fused)"

    # Each op runs outside torch.compile's graphs (a graph break per call): dynamo cannot trace
    # the kernels' binding, and under tracing the stream handle is no CUDA stream.

    def __init__(self, kernels):
        self.kernels = kernels

    @outside_compiled_graphs
    def rms_norm(self, x, weight, eps):
        # the kernels read every operand in the input's dtype
        return _RMSNorm.apply(x, weight.to(x.dtype), eps, self.kernels)

    @outside_compiled_graphs
    def layer_norm(self, x, weight, bias, eps):
        return _LayerNorm.apply(x, weight.to(x.dtype), bias.to(x.dtype), eps, self.kernels)

    @outside_compiled_graphs
    def rotary(self, x, cos, sin):
        if cos.shape[1] != 1:  # each sample's own positions: the kernel takes one table
            return torch_rotary(x, cos, sin)
        return _Rotary.apply(x, cos, sin, self.kernels)

    @outside_compiled_graphs
    def swiglu(self, h):
        return _SwiGLU.apply(h, self.kernels)

    @outside_compiled_graphs
    def cross_entropy(
        self, logits, target, tp_group, vocab_size=None, return_logsumexp=False, times=None
    ):
        vocab_start = group_rank(tp_group) * logits.shape[-1]
        limit = vocab_size if vocab_size is not None else vocab_start + logits.shape[-1]
        loss, lse = _VocabParallelCrossEntropy.apply(
            logits, target, tp_group, vocab_start, limit, self.kernels, times
        )
        return (loss, lse) if return_logsumexp else loss


def build_kernels(verbose: bool = False):
    """The compiled kernels: setup.py's build if installed, else compiled now (cached)."""
    try:
        import tripod_fused  # built by setup.py on a machine with CUDA

        return tripod_fused
    except ImportError:
        pass
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    digest = hashlib.sha1()
    for name in SOURCES + ["common.cuh", "fused.h"]:
        digest.update((CSRC / name).read_bytes())
    tag = (
        f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{major}{minor}-"
        f"{digest.hexdigest()[:10]}"
    )
    cache = Path(os.environ.get("TRIPOD_KERNEL_CACHE", Path.home() / ".cache" / "tripod")) / tag
    cache.mkdir(parents=True, exist_ok=True)
    return load(
        name="tripod_fused",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        build_directory=str(cache),
        verbose=verbose,
    )
