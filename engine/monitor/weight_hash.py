"""--check-weight-hash-across-dp-replicas-interval (Megatron-LM's meaning): every N iterations,
every data-parallel replica's parameters are hashed (SHA-256 of each parameter's bytes) and
compared; a replica whose weights drifted from the others (a silent data corruption, a rank
that skipped an update) stops the run with one line naming the parameter and the ranks of each
version.

Each rank compares within the data-parallel group of each of its model chunks (the ranks that
hold the same parameters); the ranks then agree on the first mismatch found anywhere (the one
seen by the lowest rank), so every rank stops with the same line.
"""

from __future__ import annotations

import hashlib

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


def chunk_mismatch(ddp) -> str | None:
    """Whether the replicas of one DDP-wrapped chunk hold the same parameters: None, or a
    line naming the first parameter that differs and the ranks holding each version."""
    group = ddp.dp_group
    if group is None or group_size(group) == 1:
        return None
    with ddp.gathered_parameters():
        names, params = zip(*ddp.module.named_parameters())
        mine = torch.stack([_digest(p) for p in params]).to(ddp.params[0].device)
    everyone = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    for index, name in enumerate(names):
        versions: dict[tuple, list[int]] = {}
        for rank, hashes in zip(ranks, everyone):
            versions.setdefault(tuple(hashes[index].tolist()), []).append(rank)
        if len(versions) > 1:
            held = "; ".join(
                f"one on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                for r in sorted(versions.values())
            )
            return f"{name} differs between data-parallel replicas: {held}"
    return None


def check_replicas(chunks, world_group, device: torch.device, iteration: int) -> None:
    """Compare every chunk's replicas; UserError (the same line on every rank) on a
    mismatch. Collective on every rank."""
    found = next((m for m in (chunk_mismatch(c) for c in chunks) if m), None)
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
    raise UserError(
        f"weights checked at iteration {iteration} (--check-weight-hash-across-dp-replicas-"
        f"interval): {text}",
        every_rank=True,
    )
