"""--profile: profile iterations --profile-step-start to --profile-step-end, as Megatron-LM does.

On a GPU without --use-pytorch-profiler it opens and closes the CUDA profiler's capture
range (cudaProfilerStart/Stop) around those iterations, for
`nsys profile --capture-range=cudaProfilerApi`.
With --use-pytorch-profiler, and on a CPU (where there is no CUDA profiler), it runs
torch.profiler over them and writes a Chrome trace per profiled rank to
<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz, where Megatron-LM writes it.

torch.profiler must not change state while an asynchronous collective is in flight: the
collective's end-of-record callback would then run against a profiler that has stopped, and
torch crashes (a SIGSEGV in the wait of a gloo all-gather, seen with --overlap-param-gather).
So `settle` (the optimizer's finish_param_sync: those gathers are the only collectives that
outlive an iteration) is called before every profiler step and stop.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


class StepProfiler:
    """Called at the top of every iteration and after it; inert unless --profile names this
    rank (--profile-ranks, default every rank)."""

    def __init__(
        self,
        profiling,
        tensorboard_dir: str | None,
        rank: int,
        device: torch.device,
        settle: Callable[[], None],
    ):
        """`profiling`: engine/config/profiling.py's ProfileConfig; torch.profiler's trace goes
        beside `tensorboard_dir`."""
        self.settle = settle
        ranks = profiling.profile_ranks or []
        self.enabled = bool(profiling.profile) and (not ranks or rank in ranks)
        self.start, self.end = profiling.profile_step_start, profiling.profile_step_end
        self.rank = rank
        self.torch_profiler = None
        self.cuda_range = False
        if not self.enabled:
            return
        if device.type == "cuda" and not profiling.use_pytorch_profiler:
            self.cuda_range = True
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.folder = os.path.join(tensorboard_dir, os.pardir, "torch_profile")
        self.torch_profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=max(self.start - 1, 0),
                warmup=1 if self.start > 0 else 0,
                active=self.end - self.start,
                repeat=1,
            ),
            on_trace_ready=self._export,
        )
        self.torch_profiler.start()

    @property
    def trace_path(self) -> str:
        return os.path.join(self.folder, f"rank-{self.rank}.json.gz")

    def _export(self, profiler) -> None:
        os.makedirs(self.folder, exist_ok=True)
        profiler.export_chrome_trace(self.trace_path)

    def before_iteration(self, completed: int) -> None:
        """`completed`: iterations done so far (the one about to run is completed + 1)."""
        if self.torch_profiler is not None:
            self.settle()
            self.torch_profiler.step()
        elif self.cuda_range and completed == self.start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())

    def after_iteration(self, completed: int) -> None:
        if not self.enabled or completed != self.end:
            return
        if self.torch_profiler is not None:
            self.settle()
            self.torch_profiler.stop()
            self.torch_profiler = None
        elif self.cuda_range:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.cuda_range = False

    def close(self) -> None:
        """A run that stops before --profile-step-end still writes what it profiled."""
        if self.torch_profiler is not None:
            self.settle()
            self.torch_profiler.stop()
            self.torch_profiler = None
