"""Muon under a sharded optimizer (--use-distributed-optimizer, a sharding strategy, or
--optimizer dist_muon): the Newton-Schulz work distributed by whole matrices over DP.

Muon's state stays sharded as Adam's is: each DP rank holds the momentum of its pieces (the
parts of parameters inside its shard of each gradient bucket, parallel/data_parallel/
optimizer.py), so a checkpoint reshards across DP sizes and sharding strategies as Adam's
does. Newton-Schulz needs whole matrices, so each Muon parameter has an owner, one DP rank
(assigned longest job first by the cost max(m, n) min(m, n)^2 of its matrix to the least
loaded rank; the same assignment on every rank, and on every TP rank of a DP rank). Per
gradient bucket holding Muon parameters:

1. each rank updates its pieces' momentum and writes their update U into its shard of a
   bucket-sized fp32 buffer; an all-gather over DP gives every rank the bucket's whole U;
2. each rank orthogonalises only the matrices it owns (under --muon-tp-mode duplicated or
   distributed the owner's TP ranks gather or sum over TP together, as without sharding);
3. a reduce-scatter over DP of the owners' results (zeros elsewhere) brings each rank its
   shard of the result; the matrices' scales are summed over DP in one small all-reduce.

Then each rank applies weight decay and the update to its pieces, in the unsharded step's
arithmetic (engine/optim/muon.py): for the same gradients the update equals the unsharded
one bit for bit (x + 0 is x). With expert parallelism the routed experts' buckets are a
second domain, sharded and assigned over the expert data-parallel group.
Per step this moves the Muon parameters' fp32 size in an all-gather and a reduce-scatter (an
all-reduce's volume) and holds two bucket-sized fp32 buffers at a time. megatron-core's
layer-wise optimizer keeps each whole matrix's state on its owner instead (and cannot change
the DP size on resume); torchtitan's DistMuon moves shards to owners and back, as here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.optim.muon import MuonMatrix, momentum_update, orthogonalised
from parallel.comm import all_gather_into, all_reduce, group_rank, reduce_scatter_into


@dataclass(frozen=True)
class OwnedMatrix:
    """A Muon parameter of a bucket: where it lies in the bucket's flattened parameters, the
    DP rank that orthogonalises it and its index in the step's vector of scales."""

    param: nn.Parameter
    start: int
    end: int
    matrix: MuonMatrix
    owner: int
    index: int


@dataclass(frozen=True)
class HeldPiece:
    """This rank's piece of a Muon parameter: its fp32 master (the optimizer's parameter) at
    `start` in this rank's shard of the bucket; `index`: its matrix's."""

    master: torch.Tensor
    start: int
    index: int


@dataclass(frozen=True)
class MuonBucket:
    dp_group: object
    dp_size: int
    shard_numel: int
    matrices: tuple[OwnedMatrix, ...]
    pieces: tuple[HeldPiece, ...]


@dataclass(frozen=True)
class MuonDomain:
    """The Muon buckets sharded over one DP group (the dense parameters', or with expert
    parallelism the experts' over the expert data-parallel group), in the same order on every
    rank of the group; `num_matrices`: their Muon parameters."""

    dp_group: object
    buckets: tuple[MuonBucket, ...]
    num_matrices: int


class ShardedMuon:
    """Muon's step over sharded pieces (module docstring), domain by domain: the dense
    parameters', and with expert parallelism the experts' (each expert's matrices its own)."""

    def __init__(self, domains: list[MuonDomain], settings: dict, device: torch.device):
        self.domains = domains
        self.settings = settings  # Muon's group options, for a rank without a piece of its own
        self.device = device

    def describe(self) -> str:
        """The line printed at start: how many of the Muon matrices this rank orthogonalises."""
        mine = total = 0
        for domain in self.domains:
            rank = group_rank(domain.dp_group)
            mine += sum(m.owner == rank for bucket in domain.buckets for m in bucket.matrices)
            total += domain.num_matrices
        return (
            f"Muon over sharded state: this rank orthogonalises {mine} of the {total} matrices "
            "it holds parts of (whole matrices assigned over data-parallel ranks)"
        )

    @torch.no_grad()
    def step(self, group: dict | None, state: dict) -> None:
        """One step of Muon's group; None: this rank holds no piece of a Muon weight (its
        group was left out), but it still owns matrices and joins the collectives."""
        for domain in self.domains:
            self._step(domain, group if group is not None else self.settings, state)

    def _step(self, domain: MuonDomain, group: dict, state: dict) -> None:
        lr = group["lr"]
        scales = torch.zeros(domain.num_matrices, dtype=torch.float64, device=self.device)
        results = [self._orthogonalise(b, group, state, scales) for b in domain.buckets]
        all_reduce(scales, domain.dp_group)
        scale_of = scales.tolist()
        for bucket, result in zip(domain.buckets, results, strict=True):
            for piece in bucket.pieces:
                master = piece.master
                master.mul_(1 - lr * group["weight_decay"])
                update = result[piece.start : piece.start + master.numel()]
                master.add_(update, alpha=-(lr * scale_of[piece.index]))

    def _orthogonalise(
        self, bucket: MuonBucket, group: dict, state: dict, scales: torch.Tensor
    ) -> torch.Tensor:
        """This rank's shard of the bucket's orthogonalised updates (steps 1-3), the owned
        matrices' scales written into `scales`."""
        shard = torch.zeros(bucket.shard_numel, dtype=torch.float32, device=self.device)
        for piece in bucket.pieces:
            master = piece.master
            update = momentum_update(master, state[master], group)
            shard[piece.start : piece.start + master.numel()] = update
        whole = self._gathered(shard, bucket)
        out = torch.zeros_like(whole)
        rank = group_rank(bucket.dp_group)
        for owned in bucket.matrices:
            if owned.owner != rank:
                continue
            update = whole[owned.start : owned.end].view(owned.param.shape)
            result, scale = orthogonalised(update, owned.matrix, group)
            out[owned.start : owned.end] = result.reshape(-1)
            scales[owned.index] = scale
        if bucket.dp_group is None:
            return out
        reduce_scatter_into(shard, out, bucket.dp_group)
        return shard

    @staticmethod
    def _gathered(shard: torch.Tensor, bucket: MuonBucket) -> torch.Tensor:
        if bucket.dp_group is None:
            return shard
        whole = torch.empty(bucket.shard_numel * bucket.dp_size, dtype=shard.dtype,
                            device=shard.device)  # fmt: skip
        all_gather_into(whole, shard, bucket.dp_group)
        return whole


def plan_sharded_muon(ddps, pieces, is_muon, matrix_of, settings, device) -> ShardedMuon:
    """The ShardedMuon of a sharded DistributedOptimizer's `pieces` over the DDP-wrapped
    chunks' buckets; `is_muon(param)`: whether Muon trains it, `matrix_of(param)`: its
    MuonMatrix; `settings`: Muon's group options."""
    held = {id(p.param): p for p in pieces if is_muon(p.param)}
    kinds: dict[bool, list] = {}  # dense / experts: (buffer, bucket, [params]), layout order
    for ddp in ddps:
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                params = [p for p in bucket.params if is_muon(p)]
                if params:
                    kinds.setdefault(buffer.is_expert, []).append((buffer, bucket, params))
    domains = [_domain(entries, held, matrix_of) for _, entries in sorted(kinds.items())]
    return ShardedMuon(domains, settings, device)


def _domain(entries: list, held: dict, matrix_of) -> MuonDomain:
    """One DP group's buckets, each Muon parameter given its owner."""
    if len({id(b.dp_group) for b, _, _ in entries}) > 1:
        raise ValueError("sharded Muon: buffers of one kind are sharded over one DP group")
    dp_size = entries[0][0].dp_size
    owners = _assign([param for _, _, params in entries for param in params], dp_size)
    buckets, index = [], 0
    for buffer, bucket, params in entries:
        lo, hi = buffer.shard_range(bucket)
        matrices, mine = [], []
        for param in params:
            start, end = buffer.param_range[param]
            matrices.append(OwnedMatrix(param, start - bucket.start, end - bucket.start,
                                        matrix_of(param), owners[index], index))  # fmt: skip
            piece = held.get(id(param))
            if piece is not None:
                mine.append(HeldPiece(piece.master, start + piece.offset - lo, index))
            index += 1
        buckets.append(
            MuonBucket(buffer.dp_group, buffer.dp_size, hi - lo, tuple(matrices), tuple(mine))
        )
    return MuonDomain(entries[0][0].dp_group, tuple(buckets), index)


def _assign(params: list[nn.Parameter], dp_size: int) -> list[int]:
    """Each parameter's owner: the largest Newton-Schulz cost first, to the least loaded DP
    rank (the lowest rank among equals)."""

    def cost(param) -> int:
        rows, cols = param.shape
        return max(rows, cols) * min(rows, cols) ** 2

    order = sorted(range(len(params)), key=lambda i: (-cost(params[i]), i))
    loads, owners = [0] * dp_size, [0] * len(params)
    for i in order:
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += cost(params[i])
    return owners
