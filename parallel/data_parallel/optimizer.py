"""The mixed-precision optimizer, optionally sharded over data parallelism (ZeRO-1, 2 or 3,
following the DDP wrapper's sharding strategy).

The optimizer works on fp32 "pieces" of the parameters:

- without sharding, a piece is a whole parameter, on every DP rank;
- with `shard=True` (--use-distributed-optimizer or a sharding strategy), each DP rank owns a
  1/DP slice of every gradient bucket (parallel/data_parallel/ddp.py) and its pieces are the parts
  of parameters inside that slice. fp32 master weights and the Adam moments exist only for those
  pieces, the bucket gradients arrive reduce-scattered (each rank keeps the reduced gradient
  of its slice), and after the step the updated slices are all-gathered back into every
  rank's parameters (with sharded parameters, by the next forward).

A piece's master weight is a view of the parameter itself when parameters are fp32, else an
fp32 copy (bf16/fp16 training) that is cast back after the step. Its gradient is a view of
the fp32 main-grad buffer (or of the reduced shard). Memory per parameter with bf16
parameters and Adam, by strategy: no_shard 18, optim 2 + 4 + 12/DP, optim_grads 2 + 16/DP,
optim_grads_params 18/DP bytes.

With several distributed-optimizer instances (Megatron-LM's --num-distributed-optimizer-instances),
each instance holds every element once: the norm is summed over the instance (`instance_group`),
as megatron-core's grad_stats_parallel_group.

With expert parallelism the experts' pieces come from their own buffer (sharded, when sharding,
over the expert data-parallel group). Sharded, every element is still held once over the world
(or instance); without sharding the dense parameters' squares are summed over TP x PP
(`model_parallel_group`) and the experts' over the ranks holding different experts
(`expert_norm_group`: expert TP x EP x PP), as megatron-core sums them apart.

step(): unscale (fp16), global gradient norm across TP, PP and DP (each element counted once),
skip the step if the norm is not finite (the loss scaler backs off), clip, update, copy back,
all-gather.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from parallel.comm import all_reduce
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.data_parallel.fp8_gather import weights_unchanged
from parallel.data_parallel.grad_scaler import DynamicGradScaler
from parallel.grads import agreed_norm, clip_coefficient, counts_toward_norm, squared_norm
from parallel.tensor_parallel.sharding import tp_sharding_of


@dataclass(eq=False)
class Piece:
    """The part [offset, offset + numel) of a flattened parameter that this rank updates."""

    param: nn.Parameter
    ddp: DistributedDataParallel
    offset: int
    numel: int
    master: torch.Tensor  # fp32, what the inner optimizer updates
    grad: torch.Tensor  # view of the reduced main grad (its shard with sharded gradients)
    data: torch.Tensor  # view of the parameter (its dtype)
    group: int
    expert: bool = False  # from the experts' own buffer (expert parallelism)
    fp8_gather: bool = False  # an FP8 layer's weight gathered in FP8 (its master apart)


@dataclass
class StepResult:
    updated: bool
    grad_norm: float
    loss_scale: float | None
    part_norms: dict[str, float] | None = None  # with a NormParts: the norm of each part
    num_zeros: int | None = None  # with count_zeros: zero elements of the gradient
    # with update_parts: |update| / |weight| per part, the update's RMS per optimizer (log keys)
    update_ratios: dict[str, float] | None = None


@dataclass(frozen=True)
class NormParts:
    """A breakdown of the gradient norm: `labels`, the same list on every rank, and
    `labels_of(piece)`, the indices of the labels a piece counts toward (its layer, its
    parameter group, ...). Each label's norm counts every element once, as the global one."""

    labels: tuple[str, ...]
    labels_of: Callable[[Piece], tuple[int, ...]]


class DistributedOptimizer:
    """Wraps an inner torch optimizer built over the pieces' fp32 masters.

    make_optimizer(param_groups) builds it; group_of(param) picks the index into
    group_options (e.g. with or without weight decay) for each parameter.
    """

    def __init__(
        self,
        ddps: list[DistributedDataParallel],
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        group_options: list[dict],
        group_of: Callable[[nn.Parameter], int],
        *,
        shard: bool,
        clip_grad: float = 0.0,
        grad_scaler: DynamicGradScaler | None = None,
        tp_rank: int = 0,
        model_parallel_group=None,
        instance_group=None,
        dp_group=None,
        experts_apart: bool = False,
        expert_norm_group=None,
    ):
        self.ddps = ddps
        self.device = ddps[0].params[0].device  # where this rank's collectives run
        self.shard = shard
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        self.tp_rank = tp_rank
        for ddp in ddps:
            if shard != ddp.use_distributed_optimizer:
                raise ValueError("DDP and optimizer disagree about the distributed optimizer")
        # Norm group: every element counted once. Sharded: pieces partition DP, so sum over
        # DP x TP x PP (the world, or one optimizer instance's part of it). Replicated: every
        # DP rank holds the same, sum over TP x PP.
        self.norm_group = instance_group if shard else model_parallel_group
        self.consensus_group = None if shard else dp_group
        # without sharding, experts in their own buffers: their squares summed apart (module
        # docstring); decided by the layout, the same on every rank (a pipeline stage without
        # MoE layers joins the experts' sum with nothing)
        self.experts_apart = experts_apart and not shard
        self.expert_norm_group = expert_norm_group
        self.pieces = [piece for ddp in ddps for piece in self._pieces_of(ddp, group_of)]
        # the update's RMS is logged per optimizer: each group option's "name" ("" if none)
        names = [options.get("name", "") for options in group_options]
        kinds = tuple(sorted(set(names)))
        kind_of_group = [kinds.index(name) for name in names]
        self._kinds = NormParts(kinds, lambda piece: (kind_of_group[piece.group],))
        groups = [dict(options, params=[]) for options in group_options]
        for piece in self.pieces:
            groups[piece.group]["params"].append(piece.master)
        self.optimizer = make_optimizer([g for g in groups if g["params"]])
        # an expert in its own buffer is whole on its rank (biases too) or split over the
        # expert tensor-parallel group (no biases then), never replicated: every piece counts
        self._counts = [
            counts_toward_norm(p.param, 0 if p.expert else tp_rank) for p in self.pieces
        ]

    def _pieces_of(self, ddp: DistributedDataParallel, group_of) -> list[Piece]:
        pieces = []
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                if self.shard:
                    lo, hi = buffer.shard_range(bucket)
                else:
                    lo, hi = bucket.start, bucket.end
                for param in bucket.params:
                    start, end = buffer.param_range[param]
                    a, b = max(start, lo), min(end, hi)
                    if a >= b:
                        continue
                    data = buffer.data_of(bucket, a, b)
                    # (a weight gathered in FP8 holds FP8 values: its master is apart)
                    same = data.dtype == torch.float32 and not buffer.fp8_gather
                    master = data if same else data.float().clone()
                    grad = buffer.grad_of(bucket, a, b)
                    piece = Piece(param, ddp, a - start, b - a, master, grad, data, group_of(param))
                    piece.expert, piece.fp8_gather = buffer.is_expert, buffer.fp8_gather
                    pieces.append(piece)
        return pieces

    def _summed(self, dense: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """This rank's sums over its dense and its expert pieces, summed over the ranks so
        that every element counts once (module docstring)."""
        if not self.experts_apart:
            total = dense + expert
            all_reduce(total, self.norm_group)
            return total
        all_reduce(dense, self.norm_group)
        all_reduce(expert, self.expert_norm_group)
        return dense + expert

    # --- the step -------------------------------------------------------------------------

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """Set the learning rate of every group (`decoupled_lr` for the groups whose options
        say "decoupled", when given)."""
        for group in self.optimizer.param_groups:
            use_decoupled = group.get("decoupled") and decoupled_lr is not None
            group["lr"] = decoupled_lr if use_decoupled else lr

    def set_weight_decay(self, weight_decay: float) -> None:
        """Set the weight decay of the groups whose options say "decays" (not biases and
        norms)."""
        for group in self.optimizer.param_groups:
            if group.get("decays"):
                group["weight_decay"] = weight_decay

    def zero_grad(self) -> None:
        for ddp in self.ddps:
            ddp.zero_grad_buffer()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.grad_scaler.scale if self.grad_scaler is not None else loss

    @torch.no_grad()
    def step(
        self,
        parts: NormParts | None = None,
        count_zeros: bool = False,
        update_parts: NormParts | None = None,
    ) -> StepResult:
        """One update from the (already reduced, see parallel.grads) main grads. Main grads
        kept in bf16 (--grad-reduce-in-bf16) are copied to fp32 first, as Megatron-LM does:
        unscaling, the norm, clipping and the update are in fp32. With `parts`, the norm of
        each part too (before clipping, as the global norm); with `count_zeros`, the number
        of zero elements of the gradient, every element counted once (--log-num-zeros-in-grad;
        not for a skipped update, as in Megatron-LM); with `update_parts`, the norm of each
        part's update over the norm of its weights after it (of an update taken)."""
        grads = [p.grad if p.grad.dtype == p.master.dtype else p.grad.float() for p in self.pieces]
        if self.grad_scaler is not None:
            torch._foreach_mul_(grads, self.grad_scaler.inv_scale)
        counted = [
            (g, p.expert) for g, p, c in zip(grads, self.pieces, self._counts, strict=False) if c
        ]
        squares = [
            squared_norm([g for g, expert in counted if expert == part], self.device)
            for part in (False, True)
        ]
        norm = agreed_norm(self._summed(*squares), self.consensus_group)
        part_norms = self._part_norms(grads, parts) if parts is not None else None
        finite = norm == norm and norm != float("inf")
        scale = self.grad_scaler.scale if self.grad_scaler is not None else None
        if self.grad_scaler is not None:
            self.grad_scaler.update(not finite)
        if not finite:
            for buffer in (b for ddp in self.ddps for b in ddp.buffers if b.fp8_gather):
                weights_unchanged(buffer)  # (their amaxes count for delayed scaling)
            return StepResult(False, norm, scale)  # no breakdown of a non-finite gradient
        coefficient = clip_coefficient(norm, self.clip_grad)
        if coefficient < 1.0:
            torch._foreach_mul_(grads, coefficient)
        num_zeros = (
            self._count(grads, lambda g: g.numel() - g.count_nonzero()) if count_zeros else None
        )
        for piece, grad in zip(self.pieces, grads, strict=False):
            piece.master.grad = grad
        before = [p.master.clone() for p in self.pieces] if update_parts is not None else None
        self.optimizer.step()
        ratios = self._update_ratios(before, update_parts) if before is not None else None
        self._start_publishing()
        return StepResult(
            True, norm, scale, part_norms, None if num_zeros is None else int(num_zeros), ratios
        )

    def _count(self, tensors: list[torch.Tensor], count) -> float:
        """sum(count(t)) over this rank's counted pieces' tensors (one per piece), summed so
        that every element counts once, in float64 on the group's device."""
        totals = [torch.zeros(1, dtype=torch.float64, device=self.device) for _ in range(2)]
        for tensor, piece, counts in zip(tensors, self.pieces, self._counts, strict=False):
            if counts:
                totals[piece.expert] += count(tensor)
        return self._summed(*totals).item()

    def params_norm(self) -> float:
        """The L2 norm of the parameters (their fp32 masters), every element counted once
        under any layout, as the gradient norm (--log-params-norm; Megatron-LM's
        calc_params_l2_norm)."""
        masters = [p.master for p in self.pieces]
        return math.sqrt(
            self._count(
                masters, lambda m: torch.linalg.vector_norm(m, dtype=torch.float64).square()
            )
        )

    def _part_norms(self, grads: list[torch.Tensor], parts: NormParts) -> dict[str, float]:
        """The norm of each label's part of `grads` (one tensor per piece)."""
        sums = self._label_squares(grads, parts).tolist()
        return {label: math.sqrt(v) for label, v in zip(parts.labels, sums, strict=False)}

    def _label_squares(self, tensors: list[torch.Tensor], parts: NormParts) -> torch.Tensor:
        """Sum of squares per label over this rank's counted pieces (one tensor each), summed
        over the same group as the global norm."""
        sums = torch.zeros(2, len(parts.labels), dtype=torch.float64, device=self.device)
        for piece, tensor, counts in zip(self.pieces, tensors, self._counts, strict=False):
            if counts:
                square = torch.linalg.vector_norm(tensor, dtype=torch.float64).square()
                for index in parts.labels_of(piece):
                    sums[int(piece.expert), index] += square
        return self._summed(sums[0], sums[1])

    def _update_ratios(self, before: list[torch.Tensor], parts: NormParts) -> dict[str, float]:
        """`update_ratio/<label>`: |master after - master before| / |master after| per label;
        `update_rms/<name>`: the update's root mean square per optimizer (group option
        "name"), every element counted once."""
        updates = [p.master - old for p, old in zip(self.pieces, before, strict=True)]
        steps = self._label_squares(updates, parts).tolist()
        weights = self._label_squares([p.master for p in self.pieces], parts).tolist()
        out = {
            f"update_ratio/{label}": math.sqrt(u / w) if w > 0 else 0.0
            for label, u, w in zip(parts.labels, steps, weights, strict=True)
        }
        squares = self._label_squares(updates, self._kinds).tolist()
        counts = torch.zeros(2, len(self._kinds.labels), dtype=torch.float64, device=self.device)
        for piece, counted in zip(self.pieces, self._counts, strict=True):
            if counted:
                counts[int(piece.expert), self._kinds.labels_of(piece)[0]] += _real_numel(piece)
        counts = self._summed(counts[0], counts[1]).tolist()
        for name, square, count in zip(self._kinds.labels, squares, counts, strict=True):
            if name and count:
                out[f"update_rms/{name}"] = math.sqrt(square / count)
        return out

    # --- gradients as vectors (a blend's datasets' gradients: cosines, PCGrad) -----------

    def gradient_copy(self) -> list[torch.Tensor]:
        """This rank's pieces of the (reduced) gradient, copied in fp32."""
        return [p.grad.float().clone() if p.grad.dtype != torch.float32 else p.grad.clone()
                for p in self.pieces]  # fmt: skip

    def set_gradient(self, grads: list[torch.Tensor]) -> None:
        """The pieces' gradients replaced by `grads` (as gradient_copy gives them)."""
        torch._foreach_copy_([p.grad for p in self.pieces], grads)

    def gram(self, gradients: list[list[torch.Tensor]], parts: NormParts | None = None):
        """[1 + labels, K, K] float64 dot products of K gradients (each as gradient_copy
        gives them): of the whole vectors, then of each label of `parts`; every element
        counted once under any layout, as the norm. Collective over the norm group."""
        count, labels = len(gradients), len(parts.labels) if parts is not None else 0
        sums = torch.zeros(2, 1 + labels, count, count, dtype=torch.float64, device=self.device)
        for index, (piece, counts) in enumerate(zip(self.pieces, self._counts, strict=True)):
            if not counts:
                continue
            vectors = torch.stack([g[index].reshape(-1) for g in gradients]).double()
            products = vectors @ vectors.T
            sums[int(piece.expert), 0] += products
            for label in parts.labels_of(piece) if parts is not None else ():
                sums[int(piece.expert), 1 + label] += products
        return self._summed(sums[0], sums[1])

    def dot(self, a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        """The dot product of two gradients, every element counted once (collective)."""
        return self._count(
            [
                torch.dot(x.reshape(-1).double(), y.reshape(-1).double())
                for x, y in zip(a, b, strict=True)
            ],
            lambda value: value,
        )

    def finish_param_sync(self) -> None:
        for ddp in self.ddps:
            ddp.finish_param_sync()

    @torch.no_grad()
    def publish_weights(self) -> None:
        """The masters written into the weights and the weights gathered, as every step ends:
        at the start of a run and after a checkpoint was read (its weights may be FP8 values,
        with --fp8-param-gather, where its masters are the truth; otherwise this changes
        nothing). Weights gathered in FP8 are gathered so (parallel/data_parallel/fp8_gather.py)."""
        self._start_publishing()
        self.finish_param_sync()

    def _start_publishing(self) -> None:
        """The masters back into the model's weights (in a few kernels), and their gathers
        started."""
        copies = [(p.data, p.master) for p in self.pieces if p.master is not p.data]
        if copies:
            torch._foreach_copy_(*map(list, zip(*copies, strict=False)))
        for ddp in self.ddps:
            ddp.start_param_sync()

    # --- introspection ------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: fp32 masters that are copies, plus every
        tensor in the inner optimizer's per-parameter state."""
        total = sum(p.master.numel() * 4 for p in self.pieces if p.master is not p.data)
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    total += value.numel() * value.element_size()
        return total


def _real_numel(piece: Piece) -> int:
    """The piece's elements but a vocabulary's padding rows (`real_rows`: the real rows of the
    whole TP-split table), so that an RMS does not depend on the layout's padding."""
    rows = getattr(piece.param, "real_rows", None)
    if rows is None:
        return piece.numel
    local_rows = piece.param.shape[0]
    sharding = tp_sharding_of(piece.param)
    first = sharding.tp_rank * local_rows if sharding.dim == 0 else 0
    real = min(max(rows - first, 0), local_rows) * (piece.param.numel() // local_rows)
    return min(piece.numel, max(0, real - piece.offset))
