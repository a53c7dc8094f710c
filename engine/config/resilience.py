"""Surviving the cluster (`ResilienceConfig`): the hang watchdog. Restarts are torchrun's
(--max-restarts, docs/scale.md); stopping on a signal or a time limit is ExitConfig's."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class ResilienceConfig:
    """Hang detection."""

    hang_timeout_seconds: float | None = option(
        None,
        "when a rank makes no progress for this long (choose more than the longest iteration, "
        "evaluation and save), every rank writes its stack and the collective it waits in, the "
        "ranks that did not reach it are named, and the job exits with code 75 for "
        "--max-restarts to restart (default: no watchdog)",
    )

    def validate(self) -> None:
        if self.hang_timeout_seconds is not None and self.hang_timeout_seconds <= 0:
            raise ConfigError(
                f"--hang-timeout-seconds {self.hang_timeout_seconds:g}: give a positive number "
                "of seconds (or leave it out)"
            )
