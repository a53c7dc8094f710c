"""Where training data comes from and how it is cut into samples (`DataConfig`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from engine.config.fields import option
from engine.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    """Where training data comes from and how it is cut into samples."""

    data_path: list[str] = option(
        [],
        "dataset prefix, weight/prefix pairs to blend (0.7 A 0.3 B), or prefixes alone to blend "
        "one epoch of each, weighted by size (A B)",
    )
    split: str = option("969,30,1", "train/valid/test proportions, by sequences (documents)")
    train_data_path: list[str] = option(
        [], "the train split's own paths, as --data-path (instead of --data-path and --split)"
    )
    valid_data_path: list[str] = option(
        [], "the valid split's own paths, as --data-path (instead of --data-path and --split)"
    )
    test_data_path: list[str] = option(
        [], "the test split's own paths, as --data-path (instead of --data-path and --split)"
    )
    data_args_path: str | None = option(
        None, "a file holding the --data-path list (whitespace-separated), for long blends"
    )
    data_mix_schedule: str | None = option(
        None,
        "a JSON or YAML file of blend weights over training: phases starting at a fraction of "
        "the training samples (at: 0.8) or an iteration, weights by --data-path's dataset names",
    )
    per_split_data_args_path: str | None = option(
        None,
        'a JSON file with the train/valid/test split\'s paths ({"train": [...], "valid": '
        '..., "test": ...}; lists or whitespace-separated strings)',
    )
    mock_data: bool = option(
        False,
        "train on generated documents (Megatron-LM's mock data) instead of --data-path, to try "
        "a launch with no data",
    )
    data_cache_path: str | None = option(
        None, "where dataset index caches go (default: a cache/ folder beside the data)"
    )
    num_workers: int = option(
        2, "data-loader worker processes per rank (with Parquet: per --data-path source)"
    )
    data_format: str | None = option(
        None,
        "what --data-path names: preprocessed .bin/.idx prefixes (indexed) or Parquet files and "
        "folders streamed and tokenized on the fly (parquet); default: detected from the paths",
        choices=["indexed", "parquet"],
    )
    parquet_text_column: str = option("text", "the Parquet column that holds the documents")
    reset_position_ids: bool = option(
        False, "positions start again at 0 after each end-of-document token of a sample"
    )
    reset_attention_mask: bool = option(
        False,
        "a token attends only to earlier tokens of its own document (documents end at the "
        "end-of-document token)",
    )
    eod_mask_loss: bool = option(
        False, "no loss on the prediction made at an end-of-document token"
    )
    parquet_shuffle_buffer: int = option(
        4096,
        "Parquet streaming: rows read, tokenized, packed and shuffled together (the bounded "
        "shuffle buffer, in documents)",
    )

    @property
    def masks_documents(self) -> bool:
        """Whether a sample's end-of-document tokens change its positions, attention or loss."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    @property
    def per_split_paths(self) -> tuple[list[str], list[str], list[str]] | None:
        """(train, valid, test) paths when given split by split, else None."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return paths if any(paths) else None

    def with_path_files(self) -> DataConfig:
        """This config with --data-args-path and --per-split-data-args-path read into the path
        lists (as Megatron-LM reads them); ConfigError (one line) for a file that cannot be
        used."""
        changes: dict = {}
        if self.data_args_path:
            if self.data_path:
                raise ConfigError("--data-args-path and --data-path both name the data; give one")
            changes["data_path"] = _read_text(self.data_args_path, "--data-args-path").split()
            changes["data_args_path"] = None
        if self.per_split_data_args_path:
            flag = "--per-split-data-args-path"
            if self.train_data_path or self.valid_data_path or self.test_data_path:
                raise ConfigError(
                    f"{flag} and --train/valid/test-data-path both name the data; give one"
                )
            try:
                splits = json.loads(_read_text(self.per_split_data_args_path, flag))
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{flag} {self.per_split_data_args_path}: not JSON ({err}); write "
                    '{"train": [...], "valid": [...], "test": [...]}'
                ) from None
            if not isinstance(splits, dict):
                raise ConfigError(f"{flag} {self.per_split_data_args_path}: not a JSON object")
            for name in ("train", "valid", "test"):
                value = splits.get(name) or []
                value = value.split() if isinstance(value, str) else value
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(
                        f"{flag} {self.per_split_data_args_path}: {name!r} must be a list of "
                        "strings or one string"
                    )
                changes[f"{name}_data_path"] = value
            changes["per_split_data_args_path"] = None
        return dataclasses.replace(self, **changes) if changes else self

    def validate(self) -> None:
        if self.per_split_paths and self.data_path:
            raise ConfigError(
                "--data-path and --train/valid/test-data-path name the data twice; give "
                "--data-path (cut by --split) or the per-split paths"
            )
        if self.per_split_paths and not self.train_data_path:
            raise ConfigError("--valid/test-data-path need --train-data-path too")


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(f"{flag} {path}: cannot be read ({reason})") from None
