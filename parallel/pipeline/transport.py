"""Runs a transfer plan (parallel/pipeline/plan.py) of every rank against a transport's rules,
without tensors: `check_plan(plan, "nccl")` raises ScheduleError where the ranks would hang
or a receive would take another message's data.

Both transports: each rank runs its steps in order; a Post hands its transfers over at once; a
Wait blocks the rank until what it waits for is done (a conservative model: on a GPU only the
compute stream waits, which can only hang less); a Compute needs its input received and
waited for, a Post the computes of what it sends, a Wait its batch posted. A send and a
receive match in posting order per (sender, receiver), and a matched pair completes once both
transfers are active.
- gloo: per (sender, receiver, tag) (activations and gradients have their own tags); every
  transfer is active once posted; a Wait waits for its batch's receives.
- nccl: tags are ignored; one stream per rank: a batch is active only once every batch the
  rank posted before it is done, and it is done when every transfer in it is; a Wait waits
  for the whole batch (NCCL hands back one handle per batch).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from parallel.pipeline.plan import Compute, Message, Plan, Post, Wait
from parallel.pipeline.validate import ScheduleError

TRANSPORTS = ("gloo", "nccl")


@dataclass
class _Batch:
    rank: int
    post: Post
    open: int = 0  # transfers not done yet
    open_receives: int = 0


@dataclass
class _Transfer:
    message: Message
    batch: _Batch
    done: bool = False


@dataclass
class _Ranks:
    """Every rank's progress through its steps and the transfers posted so far."""

    transport: str
    plan: Plan
    sends: dict[tuple, list[_Transfer]] = field(default_factory=dict)
    receives: dict[tuple, list[_Transfer]] = field(default_factory=dict)
    matched: dict[tuple, int] = field(default_factory=dict)  # channel -> pairs done
    dirty: set = field(default_factory=set)  # channels that may match now

    def __post_init__(self):
        p = self.plan.table.p
        self.position = [0] * p  # each rank's next step
        self.batches: list[dict[int, _Batch]] = [{} for _ in range(p)]
        self.streams: list[deque[_Batch]] = [deque() for _ in range(p)]  # nccl: not done
        self.inbox: list[set] = [set() for _ in range(p)]  # consumers whose input was waited for
        self.computed: list[set] = [set() for _ in range(p)]  # actions each rank has run
        self.woken = set(range(p))  # ranks whose transfers moved since last looked at

    def channel(self, message: Message) -> tuple:
        tag = (message.kind,) if self.transport == "gloo" else ()
        return (message.sender, message.receiver, *tag)

    def active(self, transfer: _Transfer) -> bool:
        batch = transfer.batch
        return self.transport == "gloo" or self.streams[batch.rank][0] is batch

    def finish(self, transfer: _Transfer, receive: bool) -> None:
        transfer.done = True
        batch = transfer.batch
        self.woken.add(batch.rank)
        batch.open -= 1
        batch.open_receives -= receive
        stream = self.streams[batch.rank]
        while stream and stream[0].open == 0:
            stream.popleft()
            if stream:  # the next batch is active now
                head = stream[0].post
                self.dirty.update(self.channel(m) for m in head.sends + head.receives)

    def waited_for(self, batch: _Batch) -> bool:
        return batch.open == 0 if self.transport == "nccl" else batch.open_receives == 0


def check_plan(plan: Plan, transport: str) -> None:
    """ScheduleError naming the first hang or mismatch of `plan` under `transport`'s rules."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
    ranks = _Ranks(transport, plan)
    name = f"schedule {plan.table.name} (p={plan.table.p}, m={plan.table.m}) on {transport}"
    while ranks.woken:
        for rank in sorted(ranks.woken):
            ranks.woken.discard(rank)
            _advance(ranks, rank, name)
        _match(ranks, name)
    stuck = [
        f"rank {rank} at {_describe(steps[ranks.position[rank]])}"
        for rank, steps in enumerate(plan.ranks)
        if ranks.position[rank] < len(steps)
    ]
    unsent = [t.message for queue in ranks.sends.values() for t in queue if not t.done]
    if stuck or unsent:
        waiting = ", ".join(stuck) or f"{len(unsent)} sends never received"
        raise ScheduleError(f"{name}: the transfers hang; waiting: {waiting}")


def _advance(ranks: _Ranks, rank: int, name: str) -> None:
    """Run rank's steps until one must wait."""
    steps = ranks.plan.ranks[rank]
    while ranks.position[rank] < len(steps):
        step = steps[ranks.position[rank]]
        if isinstance(step, Post):
            early = [m.producer for m in step.sends if m.producer not in ranks.computed[rank]]
            if early:
                raise ScheduleError(f"{name}: rank {rank} posts the result of {early[0]} "
                                    "before computing it")  # fmt: skip
            _post(ranks, rank, step)
        elif isinstance(step, Wait):
            batch = ranks.batches[rank].get(step.batch)
            if batch is None:
                raise ScheduleError(f"{name}: rank {rank} waits for batch {step.batch} before "
                                    "posting it")  # fmt: skip
            if not ranks.waited_for(batch):
                return
            ranks.inbox[rank].update(m.consumer for m in batch.post.receives)
        elif isinstance(step, Compute):
            source = ranks.plan.table.partner(rank, step.action, incoming=True)
            if source is not None and source[0] != rank:
                if step.action not in ranks.inbox[rank]:
                    raise ScheduleError(f"{name}: rank {rank} runs {step.action} before "
                                        "waiting for its input")  # fmt: skip
                ranks.inbox[rank].discard(step.action)
            ranks.computed[rank].add(step.action)
        ranks.position[rank] += 1


def _post(ranks: _Ranks, rank: int, post: Post) -> None:
    batch = _Batch(rank, post, len(post.sends) + len(post.receives), len(post.receives))
    ranks.batches[rank][post.batch] = batch
    if batch.open:
        ranks.streams[rank].append(batch)
    for message in post.sends:
        ranks.sends.setdefault(ranks.channel(message), []).append(_Transfer(message, batch))
    for message in post.receives:
        ranks.receives.setdefault(ranks.channel(message), []).append(_Transfer(message, batch))
    ranks.dirty.update(ranks.channel(m) for m in post.sends + post.receives)


def _match(ranks: _Ranks, name: str) -> None:
    """Complete every matched pair whose transfers are both active."""
    while ranks.dirty:
        channel = ranks.dirty.pop()
        sends, receives = ranks.sends.get(channel, []), ranks.receives.get(channel, [])
        while True:
            n = ranks.matched.get(channel, 0)
            if n >= min(len(sends), len(receives)):
                break
            send, receive = sends[n], receives[n]
            if send.message != receive.message:
                raise ScheduleError(
                    f"{name}: rank {channel[1]} would take {_describe_message(send.message)} "
                    f"as {_describe_message(receive.message)} (messages between two ranks "
                    "are matched in posting order)"
                )
            if not (ranks.active(send) and ranks.active(receive)):
                break
            ranks.finish(send, receive=False)
            ranks.finish(receive, receive=True)
            ranks.matched[channel] = n + 1


def _describe_message(message: Message) -> str:
    return (f"{message.kind} of {message.producer} on rank {message.sender} "
            f"for {message.consumer}")  # fmt: skip


def _describe(step) -> str:
    if isinstance(step, Wait):
        return f"wait for batch {step.batch}"
    if isinstance(step, Compute):
        return str(step.action)
    return f"post of batch {step.batch}"
