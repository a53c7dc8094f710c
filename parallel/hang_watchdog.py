"""A watchdog per rank that turns a hang into a report and an exit.

Each rank's training loop calls `beat()` as it makes progress. When a rank has made none for
`timeout_s`, its watchdog thread looks at the main thread: its Python stack (written out in
full) and the collective it waits in, read from the innermost `torch.distributed` call on that
stack (the operation and its process group). It also reads the sequence number of each of the
rank's process groups: a group's number counts the collectives this rank has issued on it, so
within a group the ranks behind the others are the ones that did not reach the collective the
others wait in. Every rank puts its report in the job's key-value store (which does not go
through the stuck process groups), waits a little for the others' reports, and the lowest rank
that reported prints the verdict naming the ranks that did not reach. Then every rank exits
with HANG_EXIT_CODE, so that torchrun's --max-restarts starts the job again.

A rank stuck where Python cannot run (a C call holding the interpreter lock) cannot report;
the verdict names it as silent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
import traceback

import torch.distributed as dist

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: try again (torchrun restarts the job)
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


@dataclasses.dataclass(frozen=True)
class Waiting:
    """The collective a stuck rank's main thread is in."""

    operation: str  # all_reduce, recv, barrier, ...
    group: str  # this rank's name for the group ("dp", "pp", "world", ...) or "unknown"
    group_ranks: tuple[int, ...]
    sequence: int | None  # the group's collective count on this rank
    at: str  # the caller in the project's code: file:line in function

    def describe(self) -> str:
        if not self.group_ranks:
            return f"waiting in {self.operation} (a send, receive or reduction posted earlier)"
        return (
            f"waiting in {self.operation} on group {self.group} {list(self.group_ranks)} "
            f"(sequence {self.sequence})"
        )


@dataclasses.dataclass(frozen=True)
class HangReport:
    rank: int
    host: str
    waiting: Waiting | None  # None: not in a collective (computing, or waiting elsewhere)
    at: str  # the innermost frame of the project's code
    sequences: dict[str, tuple[tuple[int, ...], int]]  # group name -> (ranks, sequence)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HangReport:
        data = json.loads(text)
        waiting = data["waiting"]
        if waiting is not None:
            waiting = Waiting(**dict(waiting, group_ranks=tuple(waiting["group_ranks"])))
        sequences = {k: (tuple(r), s) for k, (r, s) in data["sequences"].items()}
        return cls(data["rank"], data["host"], waiting, data["at"], sequences)


def _sequence(group) -> int | None:
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def _where(frame, root: str = "") -> str:
    name = frame.f_code.co_filename
    if root and name.startswith(root):
        name = os.path.relpath(name, root)
    return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"


def _own_code(frame, root: str) -> bool:
    return frame.f_code.co_filename.startswith(root) and "site-packages" not in (
        frame.f_code.co_filename
    )


def inspect_main_thread(groups: dict, root: str) -> tuple[Waiting | None, str, str]:
    """(the collective the main thread waits in, where the project's code is, the stack)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return None, "unknown", ""
    stack = "".join(traceback.format_stack(frame))
    frames = []
    while frame is not None:
        frames.append(frame)  # innermost first
        frame = frame.f_back
    own = next((f for f in frames if _own_code(f, root)), None)
    at = _where(own, root) if own is not None else "unknown"
    c10d = [f for f in frames if f.f_code.co_filename.endswith(_C10D_FILE)]
    calls = [f for f in c10d if f.f_code.co_name not in ("wrapper", "_get_default_group")]
    if not calls:
        if own is not None and any(isinstance(v, dist.Work) for v in own.f_locals.values()):
            # an operation posted earlier (isend/irecv, an async reduction), waited for here
            return Waiting("Work.wait", "unknown", (), None, at), at, stack
        return None, at, stack
    call = calls[-1]  # the outermost torch.distributed function: the one the code called
    group = call.f_locals.get("group")
    if group is None:
        group = call.f_locals.get("pg")
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    name, ranks = "unknown", ()
    for known, (members, handle) in groups.items():
        if handle is group:
            name, ranks = known, members
    if not ranks and group is not None:
        try:
            ranks = tuple(dist.get_process_group_ranks(group))
        except (RuntimeError, ValueError):
            ranks = ()
    waiting = Waiting(call.f_code.co_name, name, tuple(ranks), _sequence(group), at)
    return waiting, at, stack


def verdict(reports: dict[int, HangReport], world_size: int) -> list[str]:
    """Lines naming the ranks that did not reach a collective others wait in."""
    lines = []
    silent = [r for r in range(world_size) if r not in reports]
    behind: dict[int, set[str]] = {}
    groups: dict[tuple[str, tuple[int, ...]], dict[int, int]] = {}
    for report in reports.values():
        for name, (ranks, sequence) in report.sequences.items():
            groups.setdefault((name, tuple(ranks)), {})[report.rank] = sequence
    for (name, ranks), sequences in sorted(groups.items()):
        ahead = max(sequences.values())
        for rank, sequence in sequences.items():
            if sequence < ahead:
                behind.setdefault(rank, set()).add(f"{name} {list(ranks)}")
    for rank, names in sorted(behind.items()):
        report = reports[rank]
        lines.append(
            f"hang: rank {rank} ({report.host}) did not reach the collective its peers wait "
            f"in on group {', '.join(sorted(names))}; it is at {report.at}"
        )
    for report in sorted(reports.values(), key=lambda r: r.rank):
        if report.waiting is not None and report.rank not in behind:
            lines.append(f"hang: rank {report.rank} {report.waiting.describe()} at {report.at}")
    if silent:
        lines.append(
            f"hang: rank(s) {', '.join(map(str, silent))} sent no report (dead, or stuck "
            "where Python cannot run)"
        )
    if not behind and not silent:
        lines.append("hang: every rank reached the same collectives; the stall is inside one")
    return lines


class HangWatchdog:
    """A daemon thread per rank; `beat()` marks progress. Inert until `start()`."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        world_size: int,
        groups: dict,
        store,
        stack_dir: str | None,
        root: str,
        exit_code: int = HANG_EXIT_CODE,
        grace_s: float | None = None,
    ):
        """`groups`: name -> (ranks, process group) of this rank's groups; `store`: the
        job's key-value store (None in one process); `stack_dir`: where each rank writes its
        stack (None: stderr); `root`: the project's source folder, to find its frames."""
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        self.groups, self.store, self.stack_dir, self.root = groups, store, stack_dir, root
        self.exit_code = exit_code
        self.grace_s = min(10.0, timeout_s) if grace_s is None else grace_s
        self.last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> None:
        self.last_beat = time.monotonic()
        self._thread.start()

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            stalled = time.monotonic() - self.last_beat
            if stalled > self.timeout_s:
                self._report_and_exit(stalled)

    def _report_and_exit(self, stalled: float) -> None:
        waiting, at, stack = inspect_main_thread(self.groups, self.root)
        sequences = {
            name: (tuple(ranks), seq)
            for name, (ranks, group) in self.groups.items()
            if group is not None and (seq := _sequence(group)) is not None
        }
        report = HangReport(self.rank, socket.gethostname(), waiting, at, sequences)
        where = self._write_stack(stack)
        what = waiting.describe() if waiting else "not in a collective"
        print(
            f"rank {self.rank}: no progress for {stalled:.0f} s (--hang-timeout-seconds "
            f"{self.timeout_s:g}); {what}, at {at}; stack {where}",
            file=sys.stderr,
            flush=True,
        )
        reports = self._exchange(report)
        if min(reports) == self.rank:
            for line in verdict(reports, self.world_size):
                print(line, file=sys.stderr, flush=True)
            if self.store is not None:
                self.store.set("hang/verdict", "printed")
        elif self.store is not None:  # torchrun stops every rank once one has exited
            self._wait_for(["hang/verdict"])
        os._exit(self.exit_code)

    def _write_stack(self, stack: str) -> str:
        if self.stack_dir is None:
            print(f"rank {self.rank} stack:\n{stack}", file=sys.stderr, flush=True)
            return "above"
        os.makedirs(self.stack_dir, exist_ok=True)
        path = os.path.join(self.stack_dir, f"rank_{self.rank:05d}.txt")
        with open(path, "w") as f:
            f.write(stack)
        return f"in {path}"

    def _wait_for(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.1)

    def _exchange(self, report: HangReport) -> dict[int, HangReport]:
        """Every rank's report that arrives within the grace period (through the store)."""
        if self.store is None:
            return {self.rank: report}
        self.store.set(f"hang/{self.rank}", report.to_json())
        keys = [f"hang/{r}" for r in range(self.world_size)]
        self._wait_for(keys)
        reports = {}
        for rank, key in enumerate(keys):
            if self.store.check([key]):
                reports[rank] = HangReport.from_json(self.store.get(key).decode())
        return reports
