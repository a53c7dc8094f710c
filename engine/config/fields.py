"""Config fields that carry their command-line flag: `option(...)` holds the help text
and, where it differs from the field name, Megatron-LM's flag (engine/config/arguments.py
generates the command line from them).
"""

from __future__ import annotations

import dataclasses


def option(default, help: str, flag: str | None = None, **argparse_kwargs):
    """A dataclass field with command-line metadata (flag defaults to --field-name)."""
    metadata = {"help": help, "flag": flag, **argparse_kwargs}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# Flags Megatron-LM requires, except that --use-checkpoint-args takes them from the checkpoint.
FROM_CHECKPOINT = "use_checkpoint_args"
