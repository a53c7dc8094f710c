"""The global batch size over a run, as a function of the samples consumed so far.

Three kinds, with Megatron-LM's meanings:

- constant: --global-batch-size (default micro-batch x data-parallel size);
- --rampup-batch-size START INCREMENT SAMPLES (megatron-core 0.16's ramp-up): START samples per
  step at first, growing by INCREMENT in (global - START) / INCREMENT equal intervals spread
  over the first SAMPLES samples, then --global-batch-size; only for runs counted in samples
  (--train-samples), as Megatron-LM requires;
- --step-batch-size-schedule "0:16 2.4B:320 ...": from the given number of tokens on (suffixes
  K, M, B, T; divided by --seq-length into samples), that many samples per step.

The data order does not depend on the schedule: steps take micro-batches one after another
from the same sequence, so a larger step takes the samples a run of smaller steps would have.
The learning-rate schedule advances by the samples each step consumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import ConfigError

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str, flag: str) -> int:
    """A count with an optional K/M/B/T suffix ("2.4B" is 2_400_000_000)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = float(digits)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a number (write e.g. 250B or 1536)") from None
    if not math.isfinite(value):
        raise ConfigError(f"{flag}: {text!r} is not a finite number")
    return int(value * scale)


def parse_step_schedule(text: str | list[str], seq_length: int) -> tuple[tuple[int, int], ...]:
    """((first sample, global batch), ...) from "TOKENS:BATCH TOKENS:BATCH ..." (commas or
    spaces between entries; or a list of such strings), sorted; ConfigError (one line) for a
    schedule that cannot be used."""
    flag = "--step-batch-size-schedule"
    text = text if isinstance(text, str) else " ".join(text)
    entries = []
    for entry in text.replace(",", " ").split():
        tokens, sep, batch = entry.partition(":")
        if not sep:
            raise ConfigError(f"{flag}: entry {entry!r} is not TOKENS:BATCH (e.g. 0:16 2.4B:320)")
        entries.append((_count(tokens, flag) // seq_length, _count(batch, flag)))
    entries.sort(key=lambda e: e[0])
    if not entries:
        raise ConfigError(f'{flag}: the schedule is empty; give e.g. "0:16 2.4B:320"')
    if entries[0][0] != 0:
        raise ConfigError(
            f"{flag}: the first entry must start at 0 tokens (got {entries[0][0]} samples); "
            "add 0:BATCH"
        )
    for (before, _), (after, _) in zip(entries, entries[1:], strict=False):
        if after <= before:
            raise ConfigError(
                f"{flag}: two entries start at sample {after} (thresholds are divided by "
                "--seq-length into samples); make the thresholds further apart"
            )
    for _, batch in entries:
        if batch < 1:
            raise ConfigError(f"{flag}: batch sizes must be at least 1, got {batch}")
    return tuple(entries)


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch at each point of a run (see the module docstring)."""

    final: int
    steps: tuple[tuple[int, int], ...] = ()
    rampup: tuple[int, int, int] | None = None

    @classmethod
    def from_config(cls, train, dp: int, seq_length: int) -> BatchSchedule:
        """The schedule the flags ask for; ConfigError (one line) if they disagree."""
        if train.rampup_batch_size is not None and train.step_batch_size_schedule is not None:
            raise ConfigError(
                "--rampup-batch-size and --step-batch-size-schedule both set the batch size "
                "over the run; give one"
            )
        if train.step_batch_size_schedule is not None:
            steps = parse_step_schedule(train.step_batch_size_schedule, seq_length)
            last = steps[-1][1]
            if train.global_batch_size is not None and train.global_batch_size != last:
                raise ConfigError(
                    f"--global-batch-size {train.global_batch_size} differs from the last batch "
                    f"of --step-batch-size-schedule ({last}); drop --global-batch-size or make "
                    "them equal"
                )
            return cls(last, steps=steps)
        final = train.global_batch_size or train.micro_batch_size * dp
        if train.rampup_batch_size is None:
            return cls(final)
        start, increment, samples = train.rampup_batch_size
        flag = "--rampup-batch-size START INCREMENT SAMPLES"
        if min(start, increment, samples) < 1:
            raise ConfigError(f"{flag}: each of the three must be at least 1")
        if start > final or (final - start) % increment:
            raise ConfigError(
                f"{flag}: --global-batch-size {final} must be START ({start}) plus a whole "
                f"number of INCREMENTs ({increment})"
            )
        return cls(final, rampup=(start, increment, samples))

    def at(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples."""
        if self.rampup is not None:
            start, increment, samples = self.rampup
            if consumed > samples or start == self.final:
                return self.final
            per_increment = samples / ((self.final - start) // increment)
            return start + int(consumed / per_increment) * increment
        batch = self.final
        for first, size in self.steps:
            if consumed < first:
                break
            batch = size
        return batch

    @property
    def constant_from(self) -> int:
        """Samples consumed from which the batch no longer changes."""
        if self.rampup is not None:
            return self.rampup[2] + 1
        return self.steps[-1][0] if self.steps else 0

    def iterations_for_samples(self, train_samples: int) -> int:
        """Steps of a run of --train-samples, counted as Megatron-LM counts them: whole
        global batches; with ramp-up, the ramp's steps (the last may pass --train-samples)
        then the whole batches that fit; with a step schedule, steps until --train-samples
        is reached (the last may pass it)."""
        if self.rampup is None and not self.steps:
            return train_samples // self.final
        consumed = iterations = 0
        if self.rampup is not None:
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.at(consumed)
                iterations += 1
            return iterations + max(0, train_samples - consumed) // self.final
        while consumed < train_samples and consumed < self.constant_from:
            consumed += self.at(consumed)
            iterations += 1
        return iterations + max(0, math.ceil((train_samples - consumed) / self.final))

    def sizes(self, iterations: int) -> tuple[set[int], int]:
        """(the global batches the first `iterations` steps use, the samples they consume)."""
        consumed = done = 0
        seen = set()
        while done < iterations and consumed < self.constant_from:
            batch = self.at(consumed)
            seen.add(batch)
            consumed += batch
            done += 1
        if done < iterations:
            seen.add(self.final)
            consumed += (iterations - done) * self.final
        return seen, consumed

    def describe(self) -> str | None:
        """One line for the start of the run, or None for a constant batch."""
        if self.rampup is not None:
            start, increment, samples = self.rampup
            return (
                f"global batch ramps up from {start} by {increment} over the first {samples} "
                f"samples to {self.final} (--rampup-batch-size)"
            )
        if self.steps:
            pairs = ", ".join(f"{batch} from sample {first}" for first, batch in self.steps)
            return f"global batch by samples consumed: {pairs} (--step-batch-size-schedule)"
        return None
