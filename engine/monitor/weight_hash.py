"""Weights that several ranks hold, compared by hash (SHA-256 of each parameter's bytes):

- --check-weight-hash-across-dp-replicas-interval (Megatron-LM's meaning): every N iterations,
  every data-parallel replica's parameters;
- --test-mode (Megatron-LM's real-time test): before every iteration, the QK layernorm
  weights, which every data- and tensor-parallel rank of a pipeline stage holds alike.

A copy that drifted from the others (a silent data corruption, a rank that skipped an update)
stops the run with one line naming the parameter and the ranks of each version.

Each rank compares within the groups of each of its model chunks that hold the same
parameters (the data-parallel group; with several distributed-optimizer instances, its
instance's part of DP and then across the instances, which together join every replica; with
expert parallelism the experts over the expert data-parallel group; for the QK norms also the
tensor-parallel group); the ranks then agree on the first mismatch found
anywhere (the one seen by the lowest rank), so every rank stops with the same line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from parallel.comm import all_reduce, group_size
from parallel.errors import UserError

MESSAGE_BYTES = 1024  # the agreed line, as a fixed-size byte tensor


def _digest(param: torch.Tensor) -> torch.Tensor:
    """The SHA-256 of a parameter's bytes, as 4 int64s (hashed from a copy: numpy sharing a
    sharded parameter's storage would keep it from being released)."""
    data = param.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy()
    return torch.frombuffer(bytearray(hashlib.sha256(data.tobytes()).digest()), dtype=torch.int64)


def is_qk_norm(name: str) -> bool:
    return ".q_layernorm." in name or ".k_layernorm." in name


def chunk_mismatch(
    ddp,
    tp_group=None,
    which: Callable[[str], bool] | None = None,
    holders: str = "data-parallel replicas",
) -> str | None:
    """Whether the ranks holding one DDP-wrapped chunk's parameters (those `which` picks, every
    one by default) hold the same values: None, or a line naming the first parameter that
    differs and the ranks holding each version. Each parameter is compared over the
    data-parallel group of its buffer (the experts' over the expert data-parallel group) and
    `tp_group`, when given."""
    named = [(n, p) for n, p in ddp.module.named_parameters() if which is None or which(n)]
    if not named:  # (the same on every rank of the groups: they hold the same modules)
        return None
    dense = next((b for b in ddp.buffers if not b.is_expert), None)
    comparisons = [  # (parameters' indices, group), the same order on every rank
        ([i for i, (_, p) in enumerate(named) if ddp.buffer_of.get(p, dense) is b], group)
        for b in ddp.buffers
        for group in (b.dp_group, b.replica_group)
    ]
    comparisons.append((list(range(len(named))), tp_group))
    comparisons = [(picked, g) for picked, g in comparisons if picked and group_size(g) > 1]
    if not comparisons:
        return None
    with ddp.gathered_parameters():
        mine = torch.stack([_digest(p) for _, p in named]).to(ddp.params[0].device)
    names = [n for n, _ in named]
    found = [  # every gather runs
        _group_mismatch([names[i] for i in picked], mine[picked], group, holders)
        for picked, group in comparisons
    ]
    return next((line for line in found if line), None)


def _group_mismatch(names, mine: torch.Tensor, group, holders: str) -> str | None:
    everyone = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    for index, name in enumerate(names):
        versions: dict[tuple, list[int]] = {}
        for rank, hashes in zip(ranks, everyone, strict=False):
            versions.setdefault(tuple(hashes[index].tolist()), []).append(rank)
        if len(versions) > 1:
            held = "; ".join(
                f"one on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                for r in sorted(versions.values())
            )
            return f"{name} differs between {holders}: {held}"
    return None


def check_replicas(chunks, world_group, device: torch.device, iteration: int) -> None:
    """Compare every chunk's replicas; UserError (the same line on every rank) on a
    mismatch. Collective on every rank."""
    # every chunk's comparisons run on every rank (a mismatch one group sees must not skip
    # another group's gathers on some of its ranks)
    found = next((m for m in [chunk_mismatch(c) for c in chunks] if m), None)
    _stop_on(
        found,
        world_group,
        device,
        f"weights checked at iteration {iteration} "
        "(--check-weight-hash-across-dp-replicas-interval)",
    )


def check_qk_norms(chunks, tp_group, world_group, device: torch.device, iteration: int) -> None:
    """--test-mode: compare the QK layernorm weights over DP and TP; UserError (the same
    line on every rank) on a mismatch. Collective on every rank."""
    holders = "the data- and tensor-parallel ranks holding it"
    found = [chunk_mismatch(c, tp_group, is_qk_norm, holders) for c in chunks]
    _stop_on(
        next((m for m in found if m), None),
        world_group,
        device,
        f"QK layernorm weights checked before iteration {iteration} (--test-mode)",
    )


def _stop_on(found: str | None, world_group, device: torch.device, what: str) -> None:
    """Every rank learns the lowest rank's finding; UserError on every rank with it."""
    me = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    reporter = torch.tensor([me if found else world], dtype=torch.int64, device=device)
    all_reduce(reporter, world_group, op=dist.ReduceOp.MIN)
    if reporter.item() == world:
        return
    line = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if reporter.item() == me:
        encoded = found.encode()[:MESSAGE_BYTES]
        line[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    if world_group is not None:
        dist.broadcast(line, int(reporter.item()), group=world_group)
    text = bytes(line.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    raise UserError(f"{what}: {text}", every_rank=True)
