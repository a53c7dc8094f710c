"""Surviving the cluster (`ResilienceConfig`): the hang watchdog, the rerun of a step whose
loss or gradient is NaN/Inf, straggler reports and the heartbeat file. Restarts are torchrun's
(--max-restarts, docs/scale.md); stopping on a signal or a time limit is ExitConfig's."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class ResilienceConfig:
    """Hang detection, reruns and straggler reports."""

    hang_timeout_seconds: float | None = option(
        None,
        "when a rank makes no progress for this long (choose more than the longest iteration, "
        "evaluation and save), every rank writes its stack and the collective it waits in, the "
        "ranks that did not reach it are named, and the job exits with code 75 for "
        "--max-restarts to restart (default: no watchdog)",
    )

    rerun_on_nan: bool = option(
        False,
        "when a step's loss or gradient is NaN/Inf, compute it again from the same state and "
        "data: finite the second time is a transient fault (logged with the rank; the step "
        "goes on with the new result), NaN/Inf again is the data or the model (its samples are "
        "logged; the step is skipped as without the flag)",
    )
    rerun_mode: str = option(
        "disabled",
        "Megatron-LM's result validation: validate_results is --rerun-on-nan (a reproduced "
        "NaN/Inf is skipped here rather than checkpointed for a rerun on another GPU); "
        "report_stats is not built",
        choices=["disabled", "validate_results", "report_stats"],
    )

    log_straggler: bool = option(
        False,
        "at every log line, gather each rank's own compute time per iteration (waits for "
        "peers left out) and name the ranks slower than the median by more than "
        "--straggler-threshold, with their node",
    )
    straggler_threshold: float = option(
        0.1, "with --log-straggler: a rank this fraction slower than the median is a straggler"
    )
    straggler_minmax_count: int = option(
        1, "with --log-straggler: the slowest and fastest ranks printed at every log line"
    )

    heartbeat_dir: str | None = option(
        None,
        "the first rank of each node keeps <dir>/heartbeat_<host>.json up to date (state, "
        "iteration, samples, tokens, time; at most once a second) for a scheduler's health check",
    )

    @property
    def reruns_non_finite(self) -> bool:
        return self.rerun_on_nan or self.rerun_mode == "validate_results"

    def validate(self) -> None:
        if self.straggler_threshold <= 0:
            raise ConfigError(
                f"--straggler-threshold {self.straggler_threshold:g}: give a positive fraction "
                "(0.1: 10% slower than the median)"
            )
        if self.straggler_minmax_count < 0:
            raise ConfigError(
                f"--straggler-minmax-count {self.straggler_minmax_count}: give 0 or more"
            )
        if self.rerun_mode == "report_stats":
            raise ConfigError(
                "--rerun-mode report_stats (rerunning every step to measure non-determinism) "
                "is not built here; use validate_results or --rerun-on-nan"
            )
        if self.hang_timeout_seconds is not None and self.hang_timeout_seconds <= 0:
            raise ConfigError(
                f"--hang-timeout-seconds {self.hang_timeout_seconds:g}: give a positive number "
                "of seconds (or leave it out)"
            )
