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
    rollback_on_spike: bool = option(
        False,
        "on a loss spike, reload the newest checkpoint of --save at least --rollback-iterations "
        "before it and skip the data between that checkpoint and the spike (as PaLM); the "
        "skipped window is recorded in --save, so a later resume skips it again",
    )
    rollback_iterations: int = option(
        100, "--rollback-on-spike: how many iterations before the spike the checkpoint must be"
    )
    rollback_max: int = option(
        10,
        "--rollback-on-spike: rollbacks in the whole run; later spikes are handled as without "
        "it (kept, or skipped with --skip-spike-batches)",
    )
    skip_data_iterations: list[str] = option(
        [],
        "FIRST:LAST (1-based, as logged): the global batches those iterations would read are "
        "never trained on; when the run reaches FIRST it reads past them and trains FIRST on "
        "the data that followed (the iterations and learning rate go on from FIRST)",
        nargs="+",
    )
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

    def data_skips(self) -> list[tuple[int, int]]:
        """--skip-data-iterations as (first, last) pairs."""
        pairs = []
        for text in self.skip_data_iterations:
            first, colon, last = text.partition(":")
            if not (colon and first.strip().isdigit() and last.strip().isdigit()):
                raise ConfigError(
                    f"--skip-data-iterations {text}: give FIRST:LAST iteration numbers, such as "
                    "201:400"
                )
            pairs.append((int(first), int(last)))
        return pairs

    def validate(self) -> None:
        for first, last in self.data_skips():
            if not 1 <= first <= last:
                raise ConfigError(
                    f"--skip-data-iterations {first}:{last}: give 1 <= FIRST <= LAST (iterations "
                    "are 1-based, as logged)"
                )
        if self.rollback_iterations < 1 or self.rollback_max < 0:
            raise ConfigError(
                "--rollback-iterations must be at least 1 and --rollback-max at least 0"
            )
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
