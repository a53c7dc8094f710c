"""Checks of a schedule table (parallel/pipeline/tables.py) before it runs, and its timeline
under given action durations.

`validate(table)` raises ScheduleError naming the first violation:
- every rank runs each of its chunks' F once per micro-batch, then its backward once (B, or I
  followed later by W), and nothing else;
- a backward follows its forward, a W its I, on the same rank;
- the transfers the table implies can all happen: each rank runs its list in order, a
  compute waits for the data it receives (the neighbouring stage's F output or B/I input
  gradient), and the simulation must reach every action (else: a deadlock, named by the
  actions the ranks are stuck at);
- the table's transfer plans (parallel/pipeline/plan.py) run under gloo's and NCCL's rules
  (parallel/pipeline/transport.py: no hang, every receive takes its own message), for
  training and forward-only evaluation, with and without overlap (`check_transfers`);
- each chunk's last gradient step (B, or W) is the last micro-batch's: the runtime lets the
  data-parallel reduction start there;
- `max_in_flight` (optional): the most micro-batches of activations a rank holds at once
  (from its F until its B, or its W).

`simulate(table, durations)` returns the timeline: each action's start and end when every
rank starts an action as soon as it is free and its input has arrived (transfers take no
time), the step's length, each rank's idle share (the bubble) and peak in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.errors import ConfigError
from parallel.pipeline.tables import Action, Table


class ScheduleError(ConfigError):
    """A schedule table that cannot run as written."""


def _needs(table: Table, rank: int, action: Action) -> tuple[int, Action] | None:
    """(rank, action) whose result `action` receives, or None (it starts from local data)."""
    return table.partner(rank, action, incoming=True)


def _check_counts(table: Table) -> None:
    for rank, order in enumerate(table.ranks):
        seen: dict[Action, int] = {}
        for index, action in enumerate(order):
            if action.kind not in "FBIW" or not 0 <= action.chunk < table.v:
                raise ScheduleError(f"rank {rank} step {index}: {action} is not an action here")
            if not 0 <= action.microbatch < table.m:
                raise ScheduleError(f"rank {rank} step {index}: {action}: no such micro-batch")
            if action in seen:
                raise ScheduleError(f"rank {rank} step {index}: {action} runs twice")
            seen[action] = index
            chunk, k = action.chunk, action.microbatch
            if action.kind in "BI" and Action("F", chunk, k) not in seen:
                raise ScheduleError(f"rank {rank} step {index}: {action} before its forward")
            if action.kind == "W" and Action("I", chunk, k) not in seen:
                raise ScheduleError(f"rank {rank} step {index}: {action} before its I")
        for chunk in range(table.v):
            for k in range(table.m):
                forward = Action("F", chunk, k)
                if forward not in seen:
                    raise ScheduleError(f"rank {rank}: {forward} never runs")
                full, split = Action("B", chunk, k), Action("I", chunk, k)
                if (full in seen) == (split in seen):
                    raise ScheduleError(f"rank {rank}: chunk {chunk} micro-batch {k} needs "
                                        "one backward: B, or I and W")  # fmt: skip
                if split in seen and Action("W", chunk, k) not in seen:
                    raise ScheduleError(f"rank {rank}: W{chunk}.{k} never runs")
            last = max(i for a, i in seen.items() if a.chunk == chunk and a.kind in "BW")
            if order[last].microbatch != table.m - 1:
                raise ScheduleError(
                    f"rank {rank}: chunk {chunk}'s last gradient step is {order[last]}, not "
                    f"micro-batch {table.m - 1}'s (the data-parallel reduction starts there)"
                )


@dataclass
class Timeline:
    spans: list[list[tuple[Action, float, float]]]  # per rank: (action, start, end)
    length: float
    bubble: list[float]  # per rank: idle share of the step
    peak_in_flight: list[int]


DEFAULT_DURATIONS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def simulate(table: Table, durations: dict[str, float] | None = None) -> Timeline:
    """The timeline of the table (module docstring); ScheduleError on a deadlock."""
    durations = durations or DEFAULT_DURATIONS
    done: dict[tuple[int, Action], float] = {}
    position = [0] * table.p
    free = [0.0] * table.p
    spans: list[list] = [[] for _ in range(table.p)]
    remaining = sum(len(order) for order in table.ranks)
    while remaining:
        progressed = False
        for rank, order in enumerate(table.ranks):
            while position[rank] < len(order):
                action = order[position[rank]]
                need = _needs(table, rank, action)
                if need is not None and need not in done:
                    break
                start = max(free[rank], done[need] if need is not None else 0.0)
                end = start + durations[action.kind]
                done[rank, action] = end
                spans[rank].append((action, start, end))
                free[rank] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"rank {r} at {order[position[r]]}"
                for r, order in enumerate(table.ranks)
                if position[r] < len(order)
            )
            raise ScheduleError(f"{table.name}: deadlock; waiting: {stuck}")
    length = max(free)
    bubble = [1 - sum(e - s for _, s, e in rank) / length for rank in spans]
    return Timeline(spans, length, bubble, [_peak_in_flight(order) for order in table.ranks])


def _peak_in_flight(order) -> int:
    held = peak = 0
    split = {(a.chunk, a.microbatch) for a in order if a.kind == "I"}
    for action in order:
        if action.kind == "F":
            held += 1
            peak = max(peak, held)
        elif action.kind == "B" or (
            action.kind == "W" and (action.chunk, action.microbatch) in split
        ):
            held -= 1
    return peak


def validate(table: Table, max_in_flight: int | None = None) -> Timeline:
    """ScheduleError naming the first violation (module docstring); else the timeline."""
    _check_counts(table)
    timeline = simulate(table)
    check_transfers(table)
    if max_in_flight is not None:
        for rank, peak in enumerate(timeline.peak_in_flight):
            if peak > max_in_flight:
                raise ScheduleError(f"rank {rank} holds {peak} micro-batches of activations "
                                    f"at once, more than {max_in_flight}")  # fmt: skip
    return timeline


def check_transfers(table: Table, transports: tuple[str, ...] = ("gloo", "nccl")) -> None:
    """The table's transfer plans (parallel/pipeline/plan.py: training and forward-only, with
    and without overlap) run under each transport's rules (parallel/pipeline/transport.py)."""
    from parallel.pipeline.plan import forward_only, plan_transfers
    from parallel.pipeline.transport import check_plan

    for run in (table, forward_only(table)):
        for overlap in (False, True):
            plan = plan_transfers(run, overlap)
            for transport in transports:
                check_plan(plan, transport)
