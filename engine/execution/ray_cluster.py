"""The Ray executor: each stage's tasks as Ray tasks (one CPU each) on a Ray cluster, the
cluster at `address` (`ray start --head` on one machine, `ray start --address` on the others)
or, without one, a local cluster started for the run and stopped after it. Every machine of
the cluster must see the run's --output folder and this repository at the same paths (a
shared file system), as with datatrove's Ray executor; tasks run in the launcher's working
directory. A task whose worker dies is retried by
Ray up to `retries` times; an error a task raises (bad input) is not retried and ends the run
with that error."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import warnings

from engine.errors import ConfigError, InputError, UserError
from engine.execution.job import Stage, TaskJob

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def check_address(address: str) -> None:
    """A ConfigError unless something listens at the `host:port` of --ray-address."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address}: give host:port (the head's GCS address)")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as err:
        raise ConfigError(
            f"--ray-address {address}: nothing answers there ({err.strerror or err}); start the "
            "cluster (`ray start --head`), or leave --ray-address out to start a local one"
        ) from None


def _task_in(cwd: str, function, folder: str, stage: str, index: int) -> None:
    """The task from the launcher's working directory, where the run's relative paths lead."""
    if not os.path.isdir(cwd):
        raise InputError(
            f"{cwd}: not on this Ray node; the nodes must see the launcher's working directory, "
            "--output and the inputs at the same paths (a shared file system)"
        )
    os.chdir(cwd)
    function(folder, stage, index)


class RayExecutor:
    def __init__(self, address: str | None, retries: int, workers: int):
        self.address, self.retries, self.workers = address, retries, workers

    def run(self, job: TaskJob, stages: list[Stage]) -> None:
        # Ray's C++ side (the driver's core worker, in this process) writes its own complaints
        # to file descriptor 2 (a slow metrics agent on a loaded machine, say): they go to the
        # run's log folder, not between the user and a one-line error
        os.makedirs(job.logs, exist_ok=True)
        with _stderr_to(os.path.join(job.logs, "ray-driver.log")):
            self._run(job, stages)

    def _run(self, job: TaskJob, stages: list[Stage]) -> None:
        import ray

        address = self.address or os.environ.get("RAY_ADDRESS") or None  # Ray's own variable
        if address:
            check_address(address)
        python_path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        # the run's own settings (TRIPOD_*) go to the tasks, whose processes Ray starts
        env = {k: v for k, v in os.environ.items() if k.startswith("TRIPOD_")}
        # this driver exports no metrics: its core worker otherwise logs to stderr when the
        # node's metrics agent is slow to answer (seen on a loaded machine), which breaks a
        # one-line error; RAY_enable_metrics_collection=1 in the environment keeps them
        # (not RAY_BACKEND_LOG_LEVEL: Ray prints a line on stderr that it read it)
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        with warnings.catch_warnings():  # its notices would break a one-line error
            warnings.simplefilter("ignore")
            ray.init(
                address=address,
                num_cpus=None if address else self.workers,
                include_dashboard=False,
                runtime_env={"env_vars": {**env, "PYTHONPATH": python_path}},
                log_to_driver=False,
                logging_level=logging.ERROR,
            )
        try:
            remote = ray.remote(num_cpus=1, max_retries=self.retries)(_task_in)
            cwd = os.getcwd()
            for stage in stages:
                todo = job.pending(stage)
                refs = {
                    remote.remote(cwd, job.function, job.folder, stage.name, i): i for i in todo
                }
                self._wait(refs, stage)
        finally:
            ray.shutdown()

    def _wait(self, refs: dict, stage: Stage) -> None:
        import ray
        from ray.exceptions import RayTaskError

        for ref, index in refs.items():
            try:
                ray.get(ref)
            except RayTaskError as err:
                cause = err.cause if isinstance(err.cause, UserError) else None
                if cause is not None:
                    raise cause from None
                raise
            except ray.exceptions.RayError as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise UserError(
                    f"stage {stage.name}: task {index} failed on the Ray cluster after "
                    f"{self.retries} retries ({first}); run the same command again to resume"
                ) from None


@contextlib.contextmanager
def _stderr_to(path: str):
    """File descriptor 2 (what C++ code writes to) appended to `path` while inside; Python's
    sys.stderr is flushed first and after, and the descriptor put back on the way out."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "a") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)
