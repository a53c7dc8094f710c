"""What an executor (engine/execution/: local processes, a Ray cluster, Slurm job arrays) needs
of a run made of stages of independent tasks: the stages in order, where the tasks' markers
and logs go, and how one task runs (a module-level function for processes and Ray, a module
for `python -m` in a Slurm array). A task writes its outputs whole, then its marker: the
tasks without a marker are the ones left to run."""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    name: str
    tasks: int


@dataclass(frozen=True)
class TaskJob:
    name: str  # what the run is ("curate", "preprocess"): Slurm's job names begin with it
    folder: str  # the run's folder: the task function and module take it first
    markers: str  # <markers>/<stage>-NNNNN once a task is done
    logs: str  # Slurm: <logs>/<stage>-<task>.log
    function: Callable[[str, str, int], None]  # function(folder, stage, index)
    module: str  # python -m <module> --output <folder> --stage <stage> --index <index>

    def marker(self, stage: str, index: int) -> str:
        return os.path.join(self.markers, f"{stage}-{index:05d}")

    def pending(self, stage: Stage) -> list[int]:
        """The stage's tasks without a marker."""
        return [i for i in range(stage.tasks) if not os.path.exists(self.marker(stage.name, i))]


def fault_in_task(stage: str, index: int) -> None:
    """Fault injection for the executors' retry tests, inert unless
    TRIPOD_FAULT_KILL_TASK is `stage:index:flag-file`: the task's process kills itself
    after its work, before its marker, the first time (the flag file says it happened)."""
    spec = os.environ.get("TRIPOD_FAULT_KILL_TASK", "")
    parts = spec.split(":", 2)
    if len(parts) == 3 and parts[:2] == [stage, str(index)] and not os.path.exists(parts[2]):
        open(parts[2], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def keep_record(path: str, record: dict, refusal: str) -> None:
    """The run's record at `path`: written when absent; a different one there is another run,
    refused with `refusal` (one line naming the flag and the fix)."""
    record = json.loads(json.dumps(record))  # as read back: tuples as lists
    if os.path.exists(path):
        with open(path) as f:
            if json.load(f) != record:
                raise ConfigError(refusal)
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def task_main(run_task: Callable[[str, str, int], None], argv: list[str] | None) -> int:
    """The command line of one task (`--output FOLDER --stage NAME --index I`), as a Slurm array
    task runs it."""
    parser = argparse.ArgumentParser(description="one task of a run made of stages of tasks")
    parser.add_argument("--output", required=True, help="the run's folder")
    parser.add_argument("--stage", required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    run_task(args.output, args.stage, args.index)
    return 0
