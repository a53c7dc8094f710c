"""Every rank learns the same outcome: the first rank's error message, if any rank has one.

Used where each rank checks its own part (a checkpoint's files, a save it wrote) and all must
stop together with one message, printed once, instead of some ranks failing while the others
wait in the next collective.
"""

from __future__ import annotations

import torch.distributed as dist


def is_distributed(group=None) -> bool:
    """Whether there are other ranks to agree with: a group, or an initialised default one."""
    return group is not None or (dist.is_available() and dist.is_initialized())


def gather_to_all(value, group=None) -> list:
    """Every rank's `value`, on every rank (a list of one without other ranks)."""
    if not is_distributed(group):
        return [value]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def first_error(message: str | None, group=None) -> str | None:
    """The message of the lowest rank that has one (collective over `group`)."""
    return next((m for m in gather_to_all(message, group) if m), None)
