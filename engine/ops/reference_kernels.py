"""The fused kernels' interface (csrc/fused/bindings.cpp), implemented with PyTorch.

Same functions, arguments and results as the compiled `tripod_fused` module (the stream
handle is ignored). It is the specification the GPU parity tests hold the CUDA kernels to, and
it lets the autograd glue in engine/ops/fused.py run, and be tested, on CPU.
"""

from __future__ import annotations

import torch


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).float()


def rms_norm_fwd(x, w, eps, stream=0):
    x2 = _rows(x)
    rstd = torch.rsqrt(x2.pow(2).mean(-1) + eps)
    normed = (x2 * rstd[:, None]).to(x.dtype).float()
    return (w.float() * normed).to(x.dtype).view_as(x), rstd


def rms_norm_bwd(dy, x, w, rstd, stream=0):
    x2, g = _rows(x), _rows(dy)
    n = x2 * rstd[:, None]
    dn = g * w.float()
    mean_dot = (dn * n).mean(-1, keepdim=True)
    dx = (rstd[:, None] * (dn - n * mean_dot)).to(x.dtype).view_as(x)
    return dx, (g * n).sum(0).to(w.dtype)


def layer_norm_fwd(x, w, b, eps, stream=0):
    x2 = _rows(x)
    mean = x2.mean(-1)
    rstd = torch.rsqrt((x2 - mean[:, None]).pow(2).mean(-1) + eps)
    y = (x2 - mean[:, None]) * rstd[:, None] * w.float() + b.float()
    return y.to(x.dtype).view_as(x), mean, rstd


def layer_norm_bwd(dy, x, w, mean, rstd, stream=0):
    x2, d = _rows(x), _rows(dy)
    xhat = (x2 - mean[:, None]) * rstd[:, None]
    g = d * w.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype).view_as(x), (d * xhat).sum(0).to(w.dtype), d.sum(0).to(w.dtype)


def rotary(x, cos, sin, inverse, stream=0):
    """x [s, ..., d]; cos/sin [s, d] float32."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    c, s = cos.view(shape), sin.view(shape) * (-1.0 if inverse else 1.0)
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * c + rotated * s).to(x.dtype)


def swiglu_fwd(h, stream=0):
    gate, up = h.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(h.dtype)


def swiglu_bwd(dy, h, stream=0):
    gate, up = h.float().chunk(2, dim=-1)
    d, sg = dy.float(), torch.sigmoid(gate)
    return torch.cat([d * up * sg * (1 + gate * (1 - sg)), d * gate * sg], dim=-1).to(h.dtype)


def _padding_mask(vocab_local, vocab_start, vocab_size, device):
    return torch.arange(vocab_start, vocab_start + vocab_local, device=device) >= vocab_size


def ce_max(logits, vocab_start, vocab_size, stream=0):
    x = _rows(logits)
    pad = _padding_mask(x.shape[-1], vocab_start, vocab_size, x.device)
    return x.masked_fill(pad, -torch.finfo(torch.float32).max).max(-1).values


def ce_stats(logits, row_max, target, vocab_start, vocab_size, stream=0):
    x = _rows(logits)
    pad = _padding_mask(x.shape[-1], vocab_start, vocab_size, x.device)
    sum_exp = torch.exp(x - row_max[:, None]).masked_fill(pad, 0.0).sum(-1)
    local = target.reshape(-1) - vocab_start
    inside = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1)[:, None]).squeeze(-1) - row_max
    return sum_exp, torch.where(inside, picked, torch.zeros_like(picked))


def ce_bwd(
    logits, row_max, sum_exp, target, grad_loss, grad_lse, vocab_start, vocab_size, stream=0
):
    x = _rows(logits)
    pad = _padding_mask(x.shape[-1], vocab_start, vocab_size, x.device)
    p = (torch.exp(x - row_max[:, None]) / sum_exp[:, None]).masked_fill(pad, 0.0)
    grad = p * (grad_loss + grad_lse)[:, None]
    local = target.reshape(-1) - vocab_start
    inside = (local >= 0) & (local < x.shape[-1])
    rows = torch.arange(x.shape[0], device=x.device)[inside]
    grad[rows, local[inside]] -= grad_loss[inside]
    return grad.to(logits.dtype).view_as(logits)
