"""Profiling a range of iterations (`ProfileConfig`): nsys's capture range on a GPU, or a
torch.profiler trace."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option


@dataclass(frozen=True)
class ProfileConfig:
    """Which iterations and ranks are profiled, and how."""

    profile: bool = option(
        False,
        "profile iterations --profile-step-start to --profile-step-end: the CUDA profiler's "
        "capture range for nsys on a GPU, torch.profiler with --use-pytorch-profiler or on a "
        "CPU (a trace beside --tensorboard-dir)",
    )
    profile_step_start: int = option(10, "--profile: the iteration profiling starts at")
    profile_step_end: int = option(12, "--profile: the iteration profiling stops at")
    profile_ranks: list[int] = option([], "--profile: the ranks profiled (default: all)", nargs="*")
    use_pytorch_profiler: bool = option(
        False, "--profile with torch.profiler (a Chrome trace) also on a GPU"
    )
