"""Windows of training data that are never trained on: --skip-data-iterations FIRST:LAST, and
the window a --rollback-on-spike skips (engine/train/rollback.py). When the run reaches FIRST
it reads past the global batches iterations FIRST to LAST would have read, and trains FIRST on
the data that followed; the iteration count and the learning rate go on from FIRST.

Each window applied is kept in the checkpoints that follow (meta.json's "skipped_data"); a
rollback's window is also written to --save's skipped_data.json when it happens, so that a run
resumed from a checkpoint older than the window skips it again."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from engine.errors import ConfigError, InputError
from engine.train.batches import micro_batches_per_step

SKIPS_FILE = "skipped_data.json"


@dataclass(frozen=True)
class DataWindow:
    first: int  # the first iteration whose data is skipped (1-based, as logged)
    last: int
    cause: str  # "--skip-data-iterations" or the rollback's spike
    samples: tuple[int, int] | None = None  # [start, end) of the training samples, once read

    def describe(self) -> str:
        text = f"the data of iterations {self.first} to {self.last}"
        if self.samples is not None:
            text += f" (training samples {self.samples[0]} to {self.samples[1] - 1})"
        return text

    def record(self) -> dict:
        out = asdict(self)
        out["samples"] = list(self.samples) if self.samples is not None else None
        return out

    @classmethod
    def from_record(cls, record: dict) -> DataWindow:
        samples = record.get("samples")
        return cls(record["first"], record["last"], record["cause"],
                   tuple(samples) if samples else None)  # fmt: skip


def recorded_in(save: str | None) -> list[DataWindow]:
    """The rollback windows written to --save's skipped_data.json."""
    path = os.path.join(save, SKIPS_FILE) if save else None
    if path is None or not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            return [DataWindow.from_record(r) for r in json.load(f)]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise InputError(
            f"{path}: not a list of skipped data windows; restore it from a backup or remove it "
            "(the windows it held are then trained on when a resume reaches them)"
        ) from None


def write_recorded(save: str, windows: list[DataWindow]) -> None:
    """--save's skipped_data.json, atomically (the rank that writes meta.json calls it)."""
    path = os.path.join(save, SKIPS_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump([w.record() for w in windows], f, indent=1)
    os.replace(tmp, path)


def pending_windows(
    given: list[tuple[int, int]], recorded: list[DataWindow], applied: list[DataWindow],
    iteration: int,
) -> list[DataWindow]:  # fmt: skip
    """The windows still to skip for a run at `iteration` that has `applied` some already:
    --skip-data-iterations' and --save's recorded ones from the next iteration on. A given
    window behind `iteration` that the checkpoint did not apply is a ConfigError (its data
    was trained on). A given window inside a recorded one is done with it (a rollback's window
    holds the windows skipped in the stretch it abandoned)."""
    done = {(w.first, w.last) for w in applied}
    done |= {(first, last) for first, last in given
             if any(w.first <= first and last <= w.last for w in recorded)}  # fmt: skip
    pending = {}
    for first, last in given:
        if first <= iteration and (first, last) not in done:
            raise ConfigError(
                f"--skip-data-iterations {first}:{last}: the run resumes at iteration "
                f"{iteration}, past its start, and trained on that data; give a range that "
                f"starts after {iteration}"
            )
        if first > iteration:
            pending[(first, last)] = DataWindow(first, last, "--skip-data-iterations")
    for window in recorded:
        if window.first > iteration and (window.first, window.last) not in done:
            pending.setdefault((window.first, window.last), window)
    return sorted(pending.values(), key=lambda w: w.first)


def read_past(run, iterator, window: DataWindow) -> DataWindow:
    """Read and drop the global batches of the window (every rank, as it would train them: the
    same count of micro-batches): up to its recorded end sample where it has one (a
    rollback's, whose stretch may have skipped other windows too), else its iterations'
    batches; the counters' consumed samples move past them. Returns the window with its
    samples."""
    c, state = run.progress.counters, run.state
    start = c.consumed_samples

    def more() -> bool:
        return c.consumed_samples < window.samples[1]

    batches = iter(range(window.first, window.last + 1))
    while more() if window.samples is not None else next(batches, None) is not None:
        global_batch = run.batches.at(c.consumed_samples)
        count = micro_batches_per_step(run.cfg.training.micro_batch_size, state, global_batch)
        for _ in range(count if iterator is not None else 0):
            try:
                next(iterator)
            except StopIteration:
                raise InputError(
                    f"skipping {window.describe()}: the training split ran out at sample "
                    f"{c.consumed_samples} (it holds the run's samples and room for the "
                    "windows its flags may skip: --skip-data-iterations' and --rollback-max "
                    "rollbacks); give --skip-data-iterations from the run's start, or train "
                    "for less"
                ) from None
        c.consumed_samples += global_batch
    return DataWindow(window.first, window.last, window.cause, (start, c.consumed_samples))
