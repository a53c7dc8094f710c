"""Pipeline schedules as data: for each rank, the ordered list of compute actions it runs.

An action is F (forward), B (backward: input and weight gradients together), I (backward for
the input gradient only) or W (the weight gradients, deferred from I), of one of the rank's
model chunks on one micro-batch. Transfers are not written in the table: every F of a
virtual stage after the first receives its input from the stage before, every B or I of a
stage before the last receives its output gradient from the stage after, and each sends its
result the other way; the runtime and the validator (parallel/pipeline/validate.py) derive
them.

Where chunks sit: `loop` placement puts chunk c of rank r at virtual stage c x p + r (Megatron-
LM's interleaving; one chunk per rank is plain pipelining); `v` placement puts chunk 0 at stage
r and chunk 1 at stage 2p - 1 - r, so the last stage's forward turns straight into its own
backward (ZB-V).

Generators take (p ranks, v chunks per rank, m micro-batches) and return a Table:
- gpipe: every forward, then every backward;
- 1f1b: p - r - 1 warm-up forwards on rank r, then forward/backward pairs, then the rest of
  the backwards;
- interleaved: 1F1B over v chunks per rank, micro-batches in groups of p (Megatron-LM's
  --microbatch-group-size-per-virtual-pipeline-stage g: groups of g, p <= g <= m, the last
  group g or at least p);
- zb-h1: 1F1B with backward split into I and W, rank r holding back up to r W's and running
  them where it would otherwise wait (the peak activations stay 1F1B's p; Qi et al., "Zero
  Bubble Pipeline Parallelism", 2023, its handcrafted ZB-H1);
- zb-v: two chunks per rank in a V (m at least 2p - 1): forwards of chunk 0 down the V, then
  of both chunks, then chunk 1's F, I, W as its gradients come back, then both chunks' F, I
  and W in turn (the paper's ZB-V; with F = I = W its steady state has no bubble);
- dualpipe-v: DeepSeek-V3's DualPipe folded into a V (m at least 2p): the same placement as
  zb-v, a steady state of pairs "forward of one chunk, full backward of the other" (DualPipe
  runs each pair at once so that one's communication hides behind the other's compute; this
  runtime runs them in turn), and split backwards (I, W) only at the edges where they fill
  what would be idle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from parallel.errors import ConfigError
from parallel.pipeline.layout import virtual_stage


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B", "I" or "W"
    chunk: int  # the rank's model chunk
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


@dataclass(frozen=True)
class Table:
    name: str
    p: int
    v: int
    m: int
    placement: str  # "loop" or "v"
    ranks: tuple[tuple[Action, ...], ...]

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage (position in the model) of chunk `chunk` of rank `rank`."""
        return virtual_stage(self.placement, self.p, rank, chunk)

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) of a virtual stage."""
        if self.placement == "v":
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        return stage % self.p, stage // self.p

    @property
    def stages(self) -> int:
        return self.p * self.v

    def link(self, rank: int, action: Action, incoming: bool) -> tuple[str, int, int] | None:
        """("activation" or "gradient", rank, chunk) of the stage `action` of rank `rank`
        receives its input from (`incoming`) or sends its result to, or None: an F moves
        activations from the stage before to the stage after, a B or I gradients the other
        way, a W nothing; the first and last stage have no neighbour on their outer side."""
        stage = self.stage(rank, action.chunk)
        step = -1 if incoming else 1
        if action.kind == "F":
            other, kind = stage + step, "activation"
        elif action.kind in ("B", "I"):
            other, kind = stage - step, "gradient"
        else:
            return None
        if not 0 <= other < self.stages:
            return None
        return (kind, *self.place(other))

    def partner(self, rank: int, action: Action, incoming: bool) -> tuple[int, Action] | None:
        """(rank, action) that produces what `action` receives (`incoming`) or consumes what
        it sends: an F's activation comes from / goes to an F, a gradient from / to a B, or
        an I where that rank splits its backward; None where `link` is None."""
        link = self.link(rank, action, incoming)
        if link is None:
            return None
        kind, other, chunk = link
        k = action.microbatch
        if kind == "activation":
            return other, Action("F", chunk, k)
        split = Action("I", chunk, k) in self._split_backwards[other]
        return other, Action("I" if split else "B", chunk, k)

    @cached_property
    def _split_backwards(self) -> tuple[frozenset[Action], ...]:
        return tuple(frozenset(a for a in order if a.kind == "I") for order in self.ranks)


def gpipe(p: int, v: int, m: int) -> Table:
    _single_chunk("gpipe", v)
    ranks = [
        [Action("F", 0, k) for k in range(m)] + [Action("B", 0, k) for k in range(m)]
        for _ in range(p)
    ]
    return _table("gpipe", p, 1, m, "loop", ranks)


def warmup_forwards(
    kind: str, p: int, rank: int, m: int, v: int = 1, group: int | None = None
) -> int:
    """Forwards (of chunk-micro-batches) rank `rank` runs before its first backward
    (`group`: interleaved's micro-batch group, default p)."""
    if kind == "gpipe":
        return m
    if kind in ("1f1b", "zb-h1"):
        return min(p - rank - 1, m)
    # megatron-core 0.16.1's count (older releases ran every forward first when m == p)
    return min((p - rank - 1) * 2 + (v - 1) * (group or p), m * v)


def one_f_one_b(p: int, v: int, m: int) -> Table:
    _single_chunk("1f1b", v)
    ranks = []
    for r in range(p):
        warmup = warmup_forwards("1f1b", p, r, m)
        order = [Action("F", 0, k) for k in range(warmup)]
        for k in range(m - warmup):
            order += [Action("F", 0, warmup + k), Action("B", 0, k)]
        order += [Action("B", 0, k) for k in range(m - warmup, m)]
        ranks.append(order)
    return _table("1f1b", p, 1, m, "loop", ranks)


def interleaved(p: int, v: int, m: int, group: int | None = None) -> Table:
    if v < 2:
        raise ConfigError("the interleaved schedule needs 2 or more model chunks per rank")
    g = p if group is None else group
    flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    if not p <= g <= m:
        what = f"{flag} {g}" if group is not None else f"pipeline-model-parallel-size {p}"
        raise ConfigError(
            f"interleaved pipelining runs the micro-batches in groups of {what}, which must "
            f"lie between pipeline-model-parallel-size {p} and the micro-batches per step {m}"
        )
    if 0 < m % g < p:
        groups = f"pipeline-model-parallel-size {p}" if group is None else f"{flag} {g}"
        raise ConfigError(
            f"interleaved pipelining needs the micro-batches per step ({m}) to be a multiple "
            f"of {groups}, or to leave a last group of at least pipeline-model-parallel-size "
            f"{p} (not {m % g}; {flag} sets the group)"
        )
    # Megatron-LM's schedule table: each group of micro-batches through chunk 0, then 1, ...
    order = []
    for first in range(0, m, g):
        last = m if first + g >= m else first + g
        order += [(k, c) for c in range(v) for k in range(first, last)]

    ranks = []
    total = m * v
    for r in range(p):
        warmup = warmup_forwards("interleaved", p, r, m, v, g)

        def forward(k: int) -> Action:
            return Action("F", order[k][1], order[k][0])

        def backward(k: int) -> Action:  # the chunks the other way round
            return Action("B", v - 1 - order[k][1], order[k][0])

        steps = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            steps += [forward(warmup + k), backward(k)]
        steps += [backward(k) for k in range(total - warmup, total)]
        ranks.append(steps)
    return _table("interleaved", p, v, m, "loop", ranks)


def zb_h1(p: int, v: int, m: int) -> Table:
    _single_chunk("zb-h1", v)
    return _table("zb-h1", p, 1, m, "loop", [_zb_h1_rank(p, m, r) for r in range(p)])


def _zb_h1_rank(p: int, m: int, r: int) -> list[Action]:
    warmup = warmup_forwards("zb-h1", p, r, m)
    order = [Action("F", 0, k) for k in range(warmup)]
    pending: list[int] = []  # micro-batches whose W is held back

    def backward(k: int) -> None:
        order.append(Action("I", 0, k))
        pending.append(k)
        if len(pending) > r:  # rank r holds back at most r W's
            order.append(Action("W", 0, pending.pop(0)))

    for k in range(m - warmup):
        order.append(Action("F", 0, warmup + k))
        backward(k)
    for k in range(m - warmup, m):
        backward(k)
        if pending:  # the cool-down waits for gradients: a held-back W fills the wait
            order.append(Action("W", 0, pending.pop(0)))
    return order + [Action("W", 0, k) for k in pending]


def zb_v(p: int, v: int, m: int) -> Table:
    _v_shaped("zb-v", p, v, m)
    return _table("zb-v", p, 2, m, "v", [_zb_v_rank(p, m, r) for r in range(p)])


def _zb_v_rank(p: int, m: int, r: int) -> list[Action]:
    done = {kind: [0, 0] for kind in "FIW"}  # per kind: how many of each chunk so far
    order: list[Action] = []

    def run(kind: str, chunk: int) -> None:
        order.append(Action(kind, chunk, done[kind][chunk]))
        done[kind][chunk] += 1

    for _ in range(2 * (p - r) - 1):  # chunk 0 down the V
        run("F", 0)
    for _ in range(r):  # then both chunks
        run("F", 1)
        run("F", 0)
    for _ in range(p - r):  # chunk 1's first gradients come back from the bottom
        run("F", 1)
        run("I", 1)
        run("W", 1)
    while done["W"][0] < m or done["W"][1] < m:  # steady: both chunks, F I W
        for chunk in (0, 1):
            behind = chunk == 0 or done["F"][1] < done["F"][0]
            if done["F"][chunk] < m and behind:
                run("F", chunk)
            ready = chunk == 1 or done["I"][0] < done["I"][1]
            if done["I"][chunk] < done["F"][chunk] and ready:
                run("I", chunk)
            if done["W"][chunk] < done["I"][chunk]:
                run("W", chunk)
    return order


def dualpipe_v(p: int, v: int, m: int) -> Table:
    _v_shaped("dualpipe-v", p, v, m)
    return _table("dualpipe-v", p, 2, m, "v", [_dualpipe_v_rank(p, m, r) for r in range(p)])


def _dualpipe_v_rank(p: int, m: int, r: int) -> list[Action]:
    order: list[Action] = []
    started = {(kind, chunk): 0 for kind in "FB" for chunk in (0, 1)}  # B counts B and I
    held: list[tuple[int, int]] = []  # (chunk, micro-batch) whose W waits, oldest first

    def run(kind: str, chunk: int) -> None:
        counter = ("F" if kind == "F" else "B", chunk)
        order.append(Action(kind, chunk, started[counter]))
        if kind == "I":
            held.append((chunk, started[counter]))
        started[counter] += 1

    def oldest_weights() -> None:
        if held:
            order.append(Action("W", *held.pop(0)))

    for _ in range(2 * (p - r - 1)):  # chunk 0 down the V
        run("F", 0)
    for _ in range(r + 1):  # both chunks
        run("F", 0)
        run("F", 1)
    for _ in range(p - r - 1):  # chunk 1's first gradients: split, W at once
        run("I", 1)
        oldest_weights()
        run("F", 1)
    for _ in range(m - 2 * p + r + 1):  # steady: two (forward, backward) pairs
        run("F", 0)
        run("B", 1)
        run("F", 1)
        run("B", 0)
    for _ in range(p - r - 1):  # chunk 0's forwards are done
        run("B", 1)
        run("F", 1)
        run("B", 0)
    split = False  # cool-down: from the middle on, backwards split and W's fill the waits
    for i in range(r + 1):
        middle = i == (r + 1) // 2
        split = split or (middle and r % 2 == 1)
        run("I" if split else "B", 1)
        split = split or (middle and r % 2 == 0)
        run("I" if split else "B", 0)
    for _ in range(p - r - 1):
        oldest_weights()
        run("I" if split else "B", 0)
    while held:
        oldest_weights()
    return order


def _v_shaped(name: str, p: int, v: int, m: int) -> None:
    if v != 2:
        raise ConfigError(f"the {name} schedule runs exactly 2 model chunks per rank (a V)")
    fewest = min_microbatches(name, p)
    if m < fewest:
        raise ConfigError(f"{name} needs at least {fewest} micro-batches per step at {p} "
                          f"pipeline stages ({m} given)")  # fmt: skip


def _single_chunk(name: str, v: int) -> None:
    if v != 1:
        raise ConfigError(f"the {name} schedule runs one model chunk per rank; drop the virtual "
                          "stages or use interleaved")  # fmt: skip


def _table(name, p, v, m, placement, ranks) -> Table:
    return Table(name, p, v, m, placement, tuple(tuple(order) for order in ranks))


V_SHAPED = ("zb-v", "dualpipe-v")  # two chunks per rank in a V
PLACEMENT = dict.fromkeys(V_SHAPED, "v")  # the others: "loop"
SPLIT_BACKWARD = ("zb-h1", *V_SHAPED)  # tables with I and W: weight gradients deferred

GENERATORS: dict[str, Callable[[int, int, int], Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "dualpipe-v": dualpipe_v,
}


def default_chunks(name: str) -> int:
    """Model chunks per rank the tools run schedule `name` with (interleaved takes 2 or more;
    the V-shaped ones exactly 2)."""
    return 2 if name == "interleaved" or name in V_SHAPED else 1


def min_microbatches(name: str, p: int) -> int:
    """The fewest micro-batches per step schedule `name` runs with at p stages."""
    return {"zb-v": 2 * p - 1, "dualpipe-v": 2 * p}.get(name, 1)


def schedule_name(kind: str | None, v: int) -> str:
    """The schedule a layout runs: `kind`, or by default 1F1B (interleaved with virtual
    stages)."""
    return kind or ("interleaved" if v > 1 else "1f1b")


def build_table(name: str, p: int, v: int, m: int, group: int | None = None) -> Table:
    """Schedule `name`'s table (`group`: interleaved's micro-batch group, default p)."""
    if name not in GENERATORS:
        raise ConfigError(f"pipeline schedule {name!r} is not one of {', '.join(GENERATORS)}")
    if p < 2:
        raise ConfigError(f"the {name} schedule needs 2 or more pipeline stages")
    if name == "interleaved":
        return interleaved(p, v, m, group)
    return GENERATORS[name](p, v, m)
