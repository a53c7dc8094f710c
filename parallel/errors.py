"""Errors meant for people: each carries one line that names the file or flag and the fix.

Command-line front doors catch `UserError`, print its message and exit with code 2
(see engine/cli.py); anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An expected failure caused by input, configuration or environment."""


class InputError(UserError, ValueError):
    """Bad input data: a malformed record, a missing column, an unreadable file."""


class ConfigError(UserError, ValueError):
    """An invalid or contradictory configuration (flags, model shape, parallel layout)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete or belongs to a different model."""
