"""The Slurm executor: each stage one job array (`sbatch --array`, a task per array index),
every stage submitted at once, each depending on the one before (`--dependency=afterok:`,
`--kill-on-invalid-dep=yes`). This process then watches the queue: when a stage's array has
left it with tasks that wrote no marker (failed, killed, its node lost), the stages after it
are cancelled and submitted again behind a new array of just those tasks, up to `retries`
times. Every node must see the run's --output folder and this repository at the same paths
(a shared file system); tasks start in this process's working directory, where the run's
relative paths lead. Each task's log: <output>/work/logs/<stage>-<index>.log.

Options (`--slurm-partition`, `--slurm-time`, `--slurm-cpus-per-task`, `--slurm-mem`) go to
every array; sbatch refusing a submission (an unknown partition, a limit) ends the run with
its message in one line.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.curation.run_context import RunContext
from engine.curation.tasks import Stage, pending
from engine.errors import ConfigError, UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class SlurmOptions:
    partition: str | None = None
    time: str | None = None  # --time, e.g. 4:00:00
    cpus_per_task: int = 1
    mem: str | None = None  # --mem, e.g. 8G
    retries: int = 2


def _script(ctx: RunContext, stage: str, options: SlurmOptions) -> str:
    logs = os.path.join(ctx.work, "logs")
    os.makedirs(logs, exist_ok=True)
    python_path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "engine.curation.executors.task_main",
               "--output", ctx.output, "--stage", stage]  # fmt: skip
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=curate-{stage}",
        f"#SBATCH --output={logs}/{stage}-%a.log",
        f"#SBATCH --cpus-per-task={options.cpus_per_task}",
        *([f"#SBATCH --partition={options.partition}"] if options.partition else []),
        *([f"#SBATCH --time={options.time}"] if options.time else []),
        *([f"#SBATCH --mem={options.mem}"] if options.mem else []),
        f"export PYTHONPATH={shlex.quote(python_path)}",
        f"cd {shlex.quote(os.getcwd())}",  # the run's relative paths are this process's
        f'exec {shlex.join(command)} --index "$SLURM_ARRAY_TASK_ID"',
    ]
    return "\n".join(lines) + "\n"


def _indices(indices: list[int]) -> str:
    """An --array value: runs of consecutive indices as a-b."""
    runs, start = [], indices[0]
    for a, b in zip(indices, [*indices[1:], None], strict=True):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)


class SlurmExecutor:
    def __init__(self, options: SlurmOptions):
        self.options = options

    def _submit(self, ctx: RunContext, stage: str, indices: list[int], after: str | None) -> str:
        arguments = ["sbatch", "--parsable", f"--array={_indices(indices)}"]
        if after:
            arguments += [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
        try:
            result = subprocess.run(arguments, input=_script(ctx, stage, self.options),
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
        except FileNotFoundError:
            raise ConfigError(
                "--executor slurm: sbatch is not installed here; run on a Slurm login node"
            ) from None
        if result.returncode != 0:
            message = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
            raise ConfigError(f"--executor slurm: sbatch refused the {stage} array: {message}")
        return result.stdout.strip().split(";")[0]

    def _in_queue(self, job: str, stage: str) -> bool:
        """Whether the array still has tasks queued or running; a UserError when Slurm holds
        every one left (a launch that failed on the node: its slurmd log says why)."""
        result = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%T|%r"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        states = [line.split("|", 1) for line in result.stdout.strip().splitlines()]
        if states and all(s == "PENDING" and "held" in r.lower() for s, r in states):
            raise UserError(
                f"curation stage {stage}: Slurm holds job {job}'s tasks ({states[0][1]}); the "
                "run's arrays are cancelled: see the node's slurmd log, then run it again"
            )
        return bool(states)

    def _cancel(self, jobs: list[str]) -> None:
        if jobs:
            subprocess.run(["scancel", *jobs], capture_output=True, timeout=60)

    def run(self, ctx: RunContext, stages: list[Stage]) -> None:
        stages = [s for s in stages if pending(ctx, s)]
        jobs: list[str] = []
        try:
            for stage in stages:  # the whole pipeline queued at once, stage after stage
                jobs.append(
                    self._submit(ctx, stage.name, pending(ctx, stage), (jobs or [None])[-1])
                )
            self._watch(ctx, stages, jobs)
        finally:  # an error or an interrupt here: the arrays still queued go too
            self._cancel([job for job in jobs if self._queued(job)])

    def _queued(self, job: str) -> bool:
        result = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%i"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        return bool(result.stdout.strip())

    def _watch(self, ctx: RunContext, stages: list[Stage], jobs: list[str]) -> None:
        """Wait for each stage in turn, submitting its failed tasks (and the stages after it)
        again, up to the retries."""
        tries = dict.fromkeys(range(len(stages)), 0)
        current = 0
        while current < len(stages):
            time.sleep(POLL_SECONDS)
            if self._in_queue(jobs[current], stages[current].name):
                continue
            left = pending(ctx, stages[current])
            if not left:
                current += 1
                continue
            tries[current] += 1
            name = stages[current].name
            if tries[current] > self.options.retries:
                logs = os.path.join(ctx.work, "logs", f"{name}-{left[0]}.log")
                raise UserError(
                    f"curation stage {name}: task(s) {left[:5]} failed {tries[current]} times "
                    f"on Slurm (first log: {logs}); fix the cause and run the same command again"
                )
            self._cancel(jobs[current + 1 :])  # their dependency can no longer be met
            jobs[current] = self._submit(ctx, name, left, None)
            for k in range(current + 1, len(stages)):
                jobs[k] = self._submit(ctx, stages[k].name, pending(ctx, stages[k]), jobs[k - 1])
