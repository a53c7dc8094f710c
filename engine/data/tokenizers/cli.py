"""The tokenizer flags on a tool's command line (preprocess_data, show_samples, convert):
the same names as training's, plus the tool's own --vocab-size."""

from __future__ import annotations

import argparse

from engine.config.arguments import add_dataclass_arguments, build_configs
from engine.config.tokenizer import TokenizerConfig


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, TokenizerConfig, "tokenizer")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's vocabulary size; TikTokenizer's (default 131072)",
    )


def tokenizer_flags_given(args: argparse.Namespace) -> bool:
    return args.vocab_size is not None or any(
        key.startswith("TokenizerConfig.") for key in vars(args)
    )


def tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    cfg = build_configs(args, [TokenizerConfig])[TokenizerConfig]
    return cfg.with_vocab_size(args.vocab_size)
