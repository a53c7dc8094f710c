"""The transfers of a schedule table, planned for every rank at once: what the runtime
(parallel/pipeline/runtime.py) posts and waits for, and in which order.

Each message (a stage output to the next virtual stage, an input gradient to the one before)
gets one place in a global order: the time its producer ends in the table's simulated timeline
(parallel/pipeline/validate.py's `simulate`, default durations), then the sending rank and its
position in its list. Every rank posts its sends and receives in that order: a send right after
its compute, a receive between the last post before it in the order and the compute that
needs it. A batch holds sends and the receives of the next compute; a receive posted further
ahead goes alone (a batch ends only when all of it has arrived).

Why: NCCL runs all of a rank's transfers on a group in posting order on one stream, matches two
ranks' messages in posting order whatever their tag, and a batch ends only when every transfer
in it has met its peer. With one order shared by all ranks, the earliest message not yet
delivered is at the head of its sender's and its receiver's streams, and neither waits for
anything later in the order before posting it: it goes through, and by induction all do
(parallel/pipeline/transport.py checks each plan under NCCL's rules and gloo's). Both sides of
a pair of ranks also post their messages in the same order, so kinds can interleave freely.

`overlap` chooses where receives go. With it, each is posted as early as the order allows and
waited for just before the compute that needs it, so it arrives during the computes before
(`--overlap-p2p-communication`). Without it, each is posted as late as the order allows, and
waited for before the next compute: nothing is in flight during a compute. Sends are never
waited for until the step's end; they complete when their receivers take them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from parallel.pipeline.tables import Action, Table


@dataclass(frozen=True)
class Message:
    kind: str  # "activation" or "gradient"
    sender: int
    producer: Action  # on the sender
    receiver: int
    consumer: Action  # on the receiver
    order: tuple  # its place in the global order (module docstring)


@dataclass(frozen=True)
class Compute:
    action: Action


@dataclass(frozen=True)
class Post:
    batch: int  # numbered per rank from 0
    sends: tuple[Message, ...]
    receives: tuple[Message, ...]


@dataclass(frozen=True)
class Wait:
    batch: int  # waits for that batch's receives


Step = Compute | Post | Wait


@dataclass(frozen=True)
class Plan:
    table: Table  # what runs: forward-only keeps each rank's F's
    overlap: bool
    ranks: tuple[tuple[Step, ...], ...]


def forward_only(table: Table) -> Table:
    """The table's forwards alone, each rank's in its order (evaluation)."""
    ranks = tuple(tuple(a for a in order if a.kind == "F") for order in table.ranks)
    return Table(table.name, table.p, table.v, table.m, table.placement, ranks)


@functools.lru_cache(maxsize=64)
def plan_transfers(table: Table, overlap: bool = False) -> Plan:
    """Every rank's steps for `table` (module docstring)."""
    from parallel.pipeline.validate import simulate

    timeline = simulate(table)
    messages: list[Message] = []
    for rank, spans in enumerate(timeline.spans):
        for index, (action, _, end) in enumerate(spans):
            consumer = table.partner(rank, action, incoming=False)
            if consumer is not None and consumer[0] != rank:
                kind = "activation" if action.kind == "F" else "gradient"
                messages.append(
                    Message(kind, rank, action, consumer[0], consumer[1], (end, rank, index))
                )
    messages.sort(key=lambda m: m.order)
    ranks = tuple(_rank_steps(table, rank, messages, overlap) for rank in range(table.p))
    return Plan(table, overlap, ranks)


def _rank_steps(table: Table, rank: int, messages: list[Message], overlap: bool):
    order = table.ranks[rank]
    position = {action: index for index, action in enumerate(order)}
    steps: list[Step] = []
    batch: list[Message] = []  # sends and the next compute's receives, posted together
    pending: list[Message] = []  # receives not posted yet (without overlap: posted late)
    waits: dict[Action, list[int]] = {}  # consumer -> batches to wait for before it
    posts = 0
    done = 0  # computes emitted

    def post(messages: list[Message]) -> int:
        nonlocal posts
        sends = tuple(m for m in messages if m.sender == rank)
        receives = tuple(m for m in messages if m.receiver == rank)
        steps.append(Post(posts, sends, receives))
        posts += 1
        return posts - 1

    def close_batch() -> None:
        if batch:
            number = post(batch)
            for message in batch:
                if message.receiver == rank:
                    waits.setdefault(message.consumer, []).append(number)
            batch.clear()

    def receive(message: Message) -> None:
        """Post it now: with the next compute's batch when that compute needs it, else alone
        (a batch ends only when all of it has arrived); waited for before its consumer, or
        without overlap before the next compute (nothing arrives during a compute then)."""
        if message.consumer == order[done]:
            batch.append(message)
            return
        close_batch()
        number = post([message])
        waits.setdefault(message.consumer if overlap else order[done], []).append(number)

    def compute_through(last: int) -> None:
        nonlocal done
        while done <= last:
            action = order[done]
            needed = [i for i, m in enumerate(pending) if m.consumer == action]
            if needed:  # and, in the shared order, every receive before it
                for message in pending[: needed[-1] + 1]:
                    receive(message)
                del pending[: needed[-1] + 1]
            close_batch()
            steps.extend(Wait(number) for number in waits.pop(action, []))
            steps.append(Compute(action))
            done += 1

    for message in messages:
        if message.sender == rank:
            compute_through(position[message.producer])
            for early in pending:  # posted in the shared order: before this send
                receive(early)
            pending.clear()
            batch.append(message)
        elif message.receiver == rank:
            if overlap:
                receive(message)
            else:
                pending.append(message)
    compute_through(len(order) - 1)
    close_batch()
    return tuple(steps)
