"""The run's hang watchdog (--hang-timeout-seconds, parallel/hang_watchdog.py): this rank's
process groups by name, the job's store for the reports, and where the stacks go."""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

import engine
from engine.config.configs import Configs
from parallel.hang_watchdog import HangWatchdog
from parallel.state import ParallelState


def rank_groups(state: ParallelState, extra: dict) -> dict:
    """name -> (ranks, group) of each distinct process group this rank belongs to."""
    named = {"default": dist.group.WORLD} if dist.is_initialized() else {}
    for field in dataclasses.fields(state):
        if field.name.endswith("_group"):
            named[field.name.removesuffix("_group")] = getattr(state, field.name)
    named.update(extra)
    groups, seen = {}, set()
    for name, group in named.items():
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        groups[name] = (tuple(dist.get_process_group_ranks(group)), group)
    return groups


def build_watchdog(cfg: Configs, state: ParallelState, extra_groups: dict) -> HangWatchdog | None:
    """The watchdog of --hang-timeout-seconds (not started), or None without the flag."""
    timeout = cfg.resilience.hang_timeout_seconds
    if timeout is None:
        return None
    store = None
    if state.world_size > 1:
        store = dist.distributed_c10d._get_default_store()  # outside the process groups
        # its own connection: the main thread may be the one stuck in a store wait
        store = store.clone() if hasattr(store, "clone") else store
    save = cfg.checkpointing.save
    return HangWatchdog(
        timeout,
        state.rank,
        state.world_size,
        rank_groups(state, extra_groups),
        store,
        stack_dir=os.path.join(save, "hang_stacks") if save else None,
        root=os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__))),
    )
