"""The Slurm executor: each stage one job array (`sbatch --array`, a task per array index),
every stage submitted at once, each depending on the one before (`--dependency=afterok:`,
`--kill-on-invalid-dep=yes`). This process then watches the queue: when a stage's array has
left it with tasks that wrote no marker (failed, killed, its node lost), the stages after it
are cancelled and submitted again behind a new array of just those tasks, up to `retries`
times. Every node must see the run's --output folder and this repository at the same paths
(a shared file system); tasks start in this process's working directory, where the run's
relative paths lead, with this process's Python (the same environment must exist on every
node). Each task's log: <output>/work/logs/<stage>-<index>.log. A stage of more tasks than
Slurm's MaxArraySize is submitted as several arrays (index + offset).

Options (`--slurm-partition`, `--slurm-time`, `--slurm-cpus-per-task`, `--slurm-mem`) go to
every array; sbatch refusing a submission (an unknown partition, a limit) ends the run with
its message in one line, and so does squeue failing for 10 minutes in a row (a controller or
munge gone: finished tasks keep their markers for the next run).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.errors import ConfigError, UserError
from engine.execution.job import Stage, TaskJob

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
POLL_SECONDS = 1.0
SQUEUE_PATIENCE_SECONDS = 600.0  # squeue unanswered this long: the controller is gone


@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    time: str | None = None  # --time, e.g. 4:00:00
    cpus_per_task: int = 1
    mem: str | None = None  # --mem, e.g. 8G
    retries: int = 2


def _script(job: TaskJob, stage: str, offset: int, options: SlurmOptions) -> str:
    """The batch script of one array: task `offset + SLURM_ARRAY_TASK_ID` of the stage, its
    output to <logs>/<stage>-<task>.log."""
    logs = job.logs
    os.makedirs(logs, exist_ok=True)
    python_path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", job.module, "--output", job.folder, "--stage", stage]
    log = shlex.quote(os.path.join(logs, stage)) + '-"$TASK".log'
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.name}-{stage}",
        "#SBATCH --output=/dev/null",  # each task's own log, below
        f"#SBATCH --cpus-per-task={options.cpus_per_task}",
        *([f"#SBATCH --partition={options.partition}"] if options.partition else []),
        *([f"#SBATCH --time={options.time}"] if options.time else []),
        *([f"#SBATCH --mem={options.mem}"] if options.mem else []),
        f"TASK=$((SLURM_ARRAY_TASK_ID + {offset}))",
        f"export PYTHONPATH={shlex.quote(python_path)}",
        f"cd {shlex.quote(os.getcwd())} || exit 2",  # the run's relative paths lead from here
        f'exec {shlex.join(command)} --index "$TASK" > {log} 2>&1',
    ]
    return "\n".join(lines) + "\n"


def _array(indices: list[int]) -> str:
    """An --array value: runs of consecutive indices as a-b."""
    runs, start = [], indices[0]
    for a, b in zip(indices, [*indices[1:], None], strict=True):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess | None:
    """The command's result, or None when it could not answer (a slurmctld timeout)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)
    except subprocess.TimeoutExpired:
        return None


def max_array_size() -> int:
    """Slurm's MaxArraySize: array indices must stay below it (1001 unless configured)."""
    result = _run(["scontrol", "show", "config"])
    for line in (result.stdout if result and result.returncode == 0 else "").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            return int(value.strip())
    return 1001


def _last_error(path: str) -> str:
    """The `error: ...` line a failed task's log ends with, if any."""
    try:
        with open(path, errors="replace") as f:
            errors = [line.strip() for line in f if line.startswith("error:")]
    except OSError:
        return ""
    return f": {errors[-1]}" if errors else ""


class SlurmExecutor:
    def __init__(self, options: SlurmOptions):
        self.options = options
        self._unanswered_since: float | None = None  # squeue's first failure in a row

    def _submit(self, job: TaskJob, stage: str, tasks: list[int], after: list[str]) -> list[str]:
        """The arrays running `tasks` of the stage (one per MaxArraySize tasks), each behind
        every job of `after`."""
        if not tasks:
            return []
        size, jobs = max_array_size(), []
        for offset in range(0, max(tasks) + 1, size):
            chunk = [t - offset for t in tasks if offset <= t < offset + size]
            if not chunk:
                continue
            arguments = ["sbatch", "--parsable", f"--array={_array(chunk)}"]
            if after:
                arguments += [
                    f"--dependency=afterok:{':'.join(after)}",
                    "--kill-on-invalid-dep=yes",
                ]
            try:
                result = _run(arguments, input=_script(job, stage, offset, self.options))
            except FileNotFoundError:
                raise ConfigError(
                    "--executor slurm: sbatch is not installed here; run on a Slurm login node"
                ) from None
            if result is None or result.returncode != 0:
                message = " ".join(result.stderr.split()) if result else "no answer in 120 s"
                raise ConfigError(
                    f"--executor slurm: sbatch refused the {stage} array: {message or 'no reason'}"
                )
            jobs.append(result.stdout.strip().split(";")[0])
        return jobs

    def _in_queue(self, jobs: list[str], stage: str) -> bool:
        """Whether the arrays still have tasks queued or running (so too when squeue cannot
        answer); a UserError when Slurm holds every one left (a launch that failed on the
        node: its slurmd log says why)."""
        if not jobs:
            return False
        result = _run(["squeue", "-h", "-r", "-j", ",".join(jobs), "-o", "%T|%r"])
        if result is None or result.returncode != 0:
            self._unanswered_since = self._unanswered_since or time.monotonic()
            if time.monotonic() - self._unanswered_since > SQUEUE_PATIENCE_SECONDS:
                said = result.stderr.strip().splitlines()[-1:] if result else ["timed out"]
                raise UserError(
                    f"stage {stage}: squeue has not answered for {SQUEUE_PATIENCE_SECONDS:.0f} s "
                    f"({said[0] if said else 'no message'}); check slurmctld (and munge), "
                    "then run the same command again: finished tasks are kept"
                )
            return True
        self._unanswered_since = None
        states = [line.split("|", 1) for line in result.stdout.strip().splitlines()]
        if states and all(s == "PENDING" and "held" in r.lower() for s, r in states):
            raise UserError(
                f"stage {stage}: Slurm holds its tasks ({states[0][1]}); the run's "
                "arrays are cancelled: see the node's slurmd log, then run it again"
            )
        return bool(states)

    def _cancel(self, jobs: list[str]) -> None:
        if jobs:
            _run(["scancel", *jobs])

    def run(self, job: TaskJob, stages: list[Stage]) -> None:
        stages = [s for s in stages if job.pending(s)]
        jobs: list[list[str]] = []
        stop = _StopOnSignal()  # a SIGTERM or SIGHUP ends the watch through `finally`
        try:
            for stage in stages:  # the whole pipeline queued at once, stage after stage
                after = next((j for j in reversed(jobs) if j), [])
                jobs.append(self._submit(job, stage.name, job.pending(stage), after))
            self._watch(job, stages, jobs)
        finally:  # an error or an interrupt here: the arrays still queued go too
            self._cancel([j for stage_jobs in jobs for j in stage_jobs])
            stop.restore()

    def _watch(self, job: TaskJob, stages: list[Stage], jobs: list[list[str]]) -> None:
        """Wait for each stage in turn, submitting its failed tasks (and the stages after it)
        again, up to the retries."""
        tries = dict.fromkeys(range(len(stages)), 0)
        current = 0
        while current < len(stages):
            time.sleep(POLL_SECONDS)
            if self._in_queue(jobs[current], stages[current].name):
                continue
            left = job.pending(stages[current])
            if not left:
                current += 1
                continue
            tries[current] += 1
            name = stages[current].name
            if tries[current] > self.options.retries:
                log = os.path.join(job.logs, f"{name}-{left[0]}.log")
                raise UserError(
                    f"stage {name}: task(s) {left[:5]} failed {tries[current]} times "
                    f"on Slurm (log {log}{_last_error(log)}); fix the cause and run the same "
                    "command again"
                )
            self._cancel([j for later in jobs[current + 1 :] for j in later])
            jobs[current] = self._submit(job, name, left, [])
            for k in range(current + 1, len(stages)):
                after = next((j for j in reversed(jobs[:k]) if j), [])
                jobs[k] = self._submit(job, stages[k].name, job.pending(stages[k]), after)


class _StopOnSignal:
    """SIGTERM and SIGHUP raise SystemExit in this process while the watch runs (so that its
    `finally` cancels the queued arrays), then the handlers before are put back."""

    def __init__(self):
        self.saved = {}
        for number in (signal.SIGTERM, signal.SIGHUP):
            self.saved[number] = signal.signal(number, self._raise)

    @staticmethod
    def _raise(number, frame):
        raise SystemExit(128 + number)

    def restore(self) -> None:
        for number, handler in self.saved.items():
            signal.signal(number, handler)
