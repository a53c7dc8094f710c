"""One block of ring attention (a query chunk against a key chunk, whole or causal) through
torch's fused attention kernels that return the log-sum-exp ring attention merges by, in the
inputs' dtype (bf16 tensor cores on GPUs), instead of fp32 matmuls with score tiles.

- CUDA: the memory-efficient kernel (`_scaled_dot_product_efficient_attention`, fp32, fp16
  and bf16) and its backward;
- CPU: the flash kernel for CPU (`_scaled_dot_product_flash_attention_for_cpu`) and its
  backward.

Backward is given the merged output and log-sum-exp of the whole row (not the block's), so
the probabilities it recomputes are the final ones and its gradients are the block's share
(as flash attention's own backward works). Log-sum-exps are fp32 [b, heads, s]. A block with
a sliding window (a masked quarter) stays on the matmul path of parallel/context_parallel/
ring.py.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _heads_inside_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [b, heads, s, d] stored as [b, s, heads, d], the layout the kernel's forward writes
    its output in. Its bf16/fp16 backward reads `out` and `dout` in that layout whatever their
    strides say (measured on an H100, torch 2.11: a contiguous `out` gave gradients wrong by
    ~1.7 where the kernel's own output gave 0.01; fp32 was right either way)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


class CudaBlocks:
    """The memory-efficient kernel, whose log-sum-exp rows are padded to a multiple of 32."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[-2]]

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        rows = q.shape[-2]
        padded = lse.new_zeros(*lse.shape[:-1], -(-rows // 32) * 32)
        padded[..., :rows] = lse
        unused = torch.empty(0, device=q.device)  # the dropout seed and offset (no dropout)
        dout, out = _heads_inside_rows(dout), _heads_inside_rows(out)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, unused, unused, 0.0, [True, True, True, False],
            causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv


class CpuBlocks:
    @staticmethod
    def forward(q, k, v, causal: bool, scale: float):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal: bool, scale: float):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )


def block_kernels(device: torch.device):
    """The block kernels for tensors on `device`."""
    return CudaBlocks if torch.device(device).type == "cuda" else CpuBlocks
