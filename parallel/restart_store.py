"""The key-value store of one attempt of a job that torchrun restarts.

torchrun's elastic agent (`--max-restarts`) keeps one TCP store for the whole job and hands
every attempt's ranks the same MASTER_ADDR:MASTER_PORT. The ranks of a restarted attempt then
read the keys the previous attempt left: process-group addresses of ranks that no longer exist,
barrier counters already past, and `new_group` waits on connections that are refused. Each
attempt's ranks therefore see the store under a prefix of their own (TORCHELASTIC_RESTART_COUNT).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The store of this attempt, or None where torch's own `env://` set-up is right: not
    started by torchrun's agent, or an agent that gives every attempt a new store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes rank 0 host one)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"tripod/attempt_{attempt}/", store)
