"""The local executor: each stage's tasks in `workers` processes of this machine (one: in this
process). A worker process that dies (killed, out of memory) takes its task with it: the
tasks without a marker are run again in fresh processes, up to `retries` times; an error a
task raises (bad input) is not retried."""

from __future__ import annotations

import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from engine.errors import UserError
from engine.execution.job import Stage, TaskJob


class LocalExecutor:
    def __init__(self, workers: int, retries: int):
        self.workers, self.retries = workers, retries

    def run(self, job: TaskJob, stages: list[Stage]) -> None:
        for stage in stages:
            self._stage(job, stage)

    def _stage(self, job: TaskJob, stage: Stage) -> None:
        for attempt in range(self.retries + 1):
            todo = job.pending(stage)
            if not todo:
                return
            if self.workers <= 1:
                for index in todo:
                    job.function(job.folder, stage.name, index)
                return
            start = "fork" if sys.platform == "linux" else "spawn"
            context = multiprocessing.get_context(start)
            pool = ProcessPoolExecutor(self.workers, mp_context=context)
            try:
                futures = [pool.submit(job.function, job.folder, stage.name, i) for i in todo]
                for future in futures:
                    future.result()
            except BrokenProcessPool:
                if attempt == self.retries:
                    left = job.pending(stage)
                    raise UserError(
                        f"stage {stage.name}: task(s) {left[:5]} died in "
                        f"{self.retries + 1} tries (a worker process was killed: out of "
                        "memory?); run the same command again to resume"
                    ) from None
            finally:  # a task's error ends the stage without waiting for the others
                pool.shutdown(wait=True, cancel_futures=True)
