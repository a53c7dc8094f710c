"""When a run stops early or skips a step (`ExitConfig`): NaN/Inf losses, loss spikes, an exit
interval, a wall-clock limit, a signal."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class ExitConfig:
    """Early stops and skipped steps."""

    exit_on_nan_count: int | None = option(
        None, "stop after this many steps with a NaN/Inf loss or gradient"
    )
    spike_zscore: float = option(6.0, "a loss this many std devs above the recent mean is a spike")
    spike_window: int = option(50, "steps of loss history for spike detection")
    skip_spike_batches: bool = option(False, "skip the update of a step whose loss spikes")
    exit_interval: int | None = option(None, "stop (after saving) when iteration % this == 0")
    exit_duration_in_mins: float | None = option(
        None,
        "stop (after saving) once the processes have run this many minutes; exit code 0 "
        "(0: no limit)",
    )
    exit_signal_handler: bool = option(
        False,
        "on SIGTERM (a preempted or time-limited Slurm job): finish the iteration, save, exit "
        "with code 0",
    )
    exit_signal: str = option(
        "SIGTERM", "the signal --exit-signal-handler acts on (a name, such as SIGUSR1)"
    )
    check_weight_hash_across_dp_replicas_interval: int | None = option(
        None,
        "every this many iterations, compare the data-parallel replicas' weights (SHA-256 of "
        "each parameter) and stop, naming the parameter and ranks, if any differ",
    )
    test_mode: bool = option(
        False,
        "Megatron-LM's real-time test: before every iteration, compare the QK layernorm "
        "weights across the data- and tensor-parallel ranks (SHA-256) and stop, naming the "
        "parameter and ranks, if any differ (nothing to compare without --qk-layernorm)",
    )

    def validate(self) -> None:
        if self.exit_signal not in signal.Signals.__members__:
            raise ConfigError(
                f"--exit-signal {self.exit_signal}: not a signal name; give one such as "
                "SIGTERM or SIGUSR1"
            )
        every = self.check_weight_hash_across_dp_replicas_interval
        if every is not None and every < 1:
            raise ConfigError(
                "--check-weight-hash-across-dp-replicas-interval must be at least 1 (or left out)"
            )
