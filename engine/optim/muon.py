"""Muon: momentum orthogonalised by Newton-Schulz iterations, for 2-D weight matrices.

Per step, for a weight W with gradient G (Megatron-LM's --optimizer muon, with the meanings of
its --muon-* flags; the arithmetic in torch.optim.Muon's order, so the two give the same
update for the same settings):

    M <- lerp(M, G, 1 - momentum)                        (momentum as a moving average)
    U <- lerp(G, M, momentum) with Nesterov, else M
    O <- NS(U) * scale(rows, cols) * extra_scale_factor
    W <- W * (1 - lr * weight_decay) - lr * O            (decoupled weight decay)

NS(U): U in the iterations' precision, transposed when it has more rows than columns,
divided by its Frobenius norm (at least eps = 1e-7), then `steps` iterations X <- a X +
(b A + c A A) X with A = X X^T, the coefficients (a, b, c) of each step from the chosen set
(cycled), transposed back. Precision (--muon-fp32-matmul-prec): "medium" iterates in bf16
(as torch.optim.Muon always does, and megatron-core by default), "high" and "highest" in fp32
(under torch's float32 matmul precision of that name: TF32 on GPUs for "high").

Scale modes (--muon-scale-mode; rows and cols of the whole logical matrix):
    spectral       sqrt(max(rows, cols))      (with extra factor 0.2: torch's match_rms_adamw)
    shape_scaling  sqrt(max(1, rows / cols))  (torch's default, "original")
    unit_rms_norm  sqrt(rows / cols)

A parameter may stand for several logical matrices (a fused QKV weight: Q, K and V
orthogonalised apart) or be a shard of one (tensor parallelism): its `MuonMatrix` says how to
make the logical matrices from its momentum and how to take its own part of their updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# (a, b, c) per Newton-Schulz step, cycled: Keller Jordan's single set, and the five-step set
# megatron-core uses by default (its "quintic")
COEFFICIENTS = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
}
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
PRECISIONS = ("medium", "high", "highest")
EPS = 1e-7


def scale_factor(mode: str, rows: int, cols: int) -> float:
    """The update's shape-dependent scale (module docstring)."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"Muon scale mode {mode!r} is not one of {SCALE_MODES}")


def newton_schulz(
    update: torch.Tensor,
    steps: int,
    coefficients: str = "quintic",
    precision: str = "medium",
    shard: TensorParallelShard | None = None,
) -> torch.Tensor:
    """The orthogonalised 2-D `update` (bf16 under "medium", else fp32). With `shard`, the
    update is one TP rank's shard of the matrix (--muon-tp-mode distributed): the sharded
    dimension is the one the Gram matrix X X^T sums over, and its partial sums (and the
    norm's) are added over the TP group, so every rank gets its shard of the whole matrix's
    result without gathering it."""
    if update.ndim != 2:
        raise ValueError(f"Newton-Schulz takes a matrix, not a tensor of shape {update.shape}")
    sets = COEFFICIENTS[coefficients]
    x = update.bfloat16() if precision == "medium" else update.float()
    tall = update.size(0) > update.size(1) if shard is None else shard.dim == 0
    if tall:
        x = x.T
    if shard is None:
        x = x.div(x.norm().clamp(min=EPS))
    else:
        squares = x.float().square().sum()
        shard.sum(squares)
        x = x.div(squares.sqrt().clamp(min=EPS).to(x.dtype))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "high" else "highest")
    try:
        for step in range(steps):
            a, b, c = sets[step % len(sets)]
            gram = x @ x.T
            if shard is not None:
                shard.sum(gram)
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    finally:
        torch.set_float32_matmul_precision(previous)
    return x.T if tall else x


@dataclass(frozen=True)
class TensorParallelShard:
    """A parameter that is one TP rank's shard of its matrix, split along `dim` into `size`
    parts; `sum(tensor)`: adds a tensor in place over the TP group."""

    dim: int
    size: int
    sum: Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class MuonMatrix:
    """How a parameter's momentum becomes the logical matrices Muon orthogonalises.

    `rows_split`: the parameter's rows are `groups` repeats of these row counts (a fused QKV
    weight gathered over TP: each rank's Q rows, K rows and V rows in turn, one group per
    rank); each part over all groups is one matrix. `gather`/`own`: a tensor-parallel
    shard's full matrix from every rank's shard, and this rank's part of a full-size update
    (None: the parameter is whole);
    the scales follow the gathered matrices' shapes. `shape`: the matrix's shape where the
    parameter is held flat (the optimizer's fp32 masters). `shard`: the parameter is a TP
    shard orthogonalised as one without gathering it; the scales follow the whole shapes."""

    shape: tuple[int, int] | None = None
    rows_split: tuple[int, ...] = ()
    groups: int = 1
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    own: Callable[[torch.Tensor], torch.Tensor] | None = None
    shard: TensorParallelShard | None = None  # --muon-tp-mode distributed (newton_schulz)


def orthogonalised(
    update: torch.Tensor, matrix: MuonMatrix, settings: dict
) -> tuple[torch.Tensor, float]:
    """(NS of the update, its scale x extra factor) for the parameter `matrix` describes, in
    the parameter's shape. A whole matrix's NS comes back as it is (bf16 under "medium") with
    its scale apart, for the caller to fold into the step size as torch.optim.Muon does; the
    parts of a split matrix come back scaled, in fp32, with a scale of 1."""
    full = matrix.gather(update) if matrix.gather is not None else update
    if matrix.rows_split:
        per_group = full.view(matrix.groups, sum(matrix.rows_split), full.shape[1])
        done = []
        for part in per_group.split(list(matrix.rows_split), dim=1):
            out, scale = _one_matrix(part.reshape(-1, full.shape[1]), settings, matrix.shard)
            done.append((out.float() * scale).reshape(part.shape))
        out, scale = torch.cat(done, dim=1).reshape(full.shape), 1.0
    else:
        out, scale = _one_matrix(full, settings, matrix.shard)
    return (matrix.own(out) if matrix.own is not None else out), scale


def _one_matrix(
    update: torch.Tensor, settings: dict, shard: TensorParallelShard | None
) -> tuple[torch.Tensor, float]:
    out = newton_schulz(update, settings["ns_steps"], settings["coefficients"],
                        settings["precision"], shard)  # fmt: skip
    rows, cols = update.shape
    if shard is not None:  # the whole matrix's shape
        rows, cols = (rows * shard.size, cols) if shard.dim == 0 else (rows, cols * shard.size)
    return out, scale_factor(settings["scale_mode"], rows, cols) * settings["extra_scale_factor"]


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters (module docstring). `matrices`: a MuonMatrix per parameter
    that is not a whole single matrix (by identity; the rest are whole). State per parameter:
    `momentum_buffer`, fp32, the parameter's shape."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        coefficients: str = "simple",
        precision: str = "medium",
        scale_mode: str = "shape_scaling",
        extra_scale_factor: float = 1.0,
        matrices: dict[torch.Tensor, MuonMatrix] | None = None,
    ):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum {momentum} is not in [0, 1)")
        if ns_steps < 1:
            raise ValueError(f"Muon needs at least one Newton-Schulz step, not {ns_steps}")
        if coefficients not in COEFFICIENTS or precision not in PRECISIONS:
            raise ValueError(f"Muon coefficients {coefficients!r} / precision {precision!r}")
        scale_factor(scale_mode, 1, 1)  # (checks the mode)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, coefficients=coefficients, precision=precision,
                        scale_mode=scale_mode, extra_scale_factor=extra_scale_factor)  # fmt: skip
        super().__init__(params, defaults)
        self.matrices = dict(matrices or {})
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2 and self.matrices.get(p, MuonMatrix()).shape is None:
                    raise ValueError(f"Muon takes 2-D parameters, not one of shape {p.shape}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            muon_step(group, self.state, self.matrices)
        return loss


def muon_step(group: dict, state: dict, matrices: dict) -> None:
    """One Muon update of each parameter of `group` that has a gradient (module docstring);
    `state`: the optimizer's, per parameter; `matrices`: MuonMatrix by parameter."""
    lr = group["lr"]
    for p in group["params"]:
        if p.grad is None:
            continue
        matrix = matrices.get(p, MuonMatrix())
        update = momentum_update(p, state[p], group)
        if matrix.shape is not None:  # a flat parameter: its matrix
            update = update.view(matrix.shape)
        out, scale = orthogonalised(update, matrix, group)
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(out.reshape(p.shape), alpha=-(lr * scale))


def momentum_update(p: torch.Tensor, entry: dict, group: dict) -> torch.Tensor:
    """The momentum (`entry["momentum_buffer"]`, made on the first step) moved toward p's
    gradient, and the update it gives (module docstring), both in p's shape."""
    momentum = group["momentum"]
    if "momentum_buffer" not in entry:
        entry["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
    buffer, grad = entry["momentum_buffer"], p.grad.float()
    buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(buffer, momentum) if group["nesterov"] else buffer
