"""Fill-in-the-middle training data (`FimConfig`): Megatron-LM's --fim-* flags, their meanings
and defaults (engine/data/fim.py transforms the samples)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class FimConfig:
    """Which samples are rearranged into fill-in-the-middle form, and the tokens that mark it."""

    fim_data: bool = option(
        False,
        "rearrange documents of the samples into fill-in-the-middle form (prefix, suffix, "
        "middle), for code models",
    )
    fim_rate: float = option(0.5, "probability that a document is rearranged")
    fim_spm_rate: float = option(
        0.5, "probability that a rearranged document is suffix-prefix-middle (else PSM)"
    )
    fim_split_sample: str | None = option(
        None,
        "a token that splits each document into fragments (files of a repository), each "
        "rearranged on its own at --fim-fragment-rate",
    )
    fim_fragment_rate: float | None = option(
        None, "probability that a fragment is rearranged (with --fim-split-sample)"
    )
    fim_no_prefix: str | None = option(
        None, "leave documents (or fragments) whose text starts with this as they are"
    )
    fim_prefix_token: str = option("<fim_prefix>", "the token before the prefix")
    fim_middle_token: str = option("<fim_middle>", "the token before the middle")
    fim_suffix_token: str = option("<fim_suffix>", "the token before the suffix")
    fim_pad_token: str = option("<fim_pad>", "the token that pads a sample grown shorter")
    fim_eod_token: str = option(
        "<|endoftext|>", "the end-of-document token the samples are split into documents at"
    )

    def validate(self) -> None:
        rates = (
            ("--fim-rate", self.fim_rate),
            ("--fim-spm-rate", self.fim_spm_rate),
            ("--fim-fragment-rate", self.fim_fragment_rate),
        )
        for flag, value in rates:
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{flag} {value}: a probability, between 0 and 1")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            raise ConfigError(
                "--fim-split-sample needs --fim-fragment-rate (the probability that each "
                "fragment is rearranged)"
            )

    @property
    def token_flags(self) -> dict[str, str]:
        """{flag: token text} of the tokens the tokenizer must have."""
        out = {
            "--fim-prefix-token": self.fim_prefix_token,
            "--fim-middle-token": self.fim_middle_token,
            "--fim-suffix-token": self.fim_suffix_token,
            "--fim-pad-token": self.fim_pad_token,
            "--fim-eod-token": self.fim_eod_token,
        }
        if self.fim_split_sample is not None:
            out["--fim-split-sample"] = self.fim_split_sample
        return out
