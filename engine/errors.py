"""The engine's user-facing errors (defined in parallel/errors.py, the lowest layer that raises
them, so that every import points downward); see there."""

from parallel.errors import CheckpointError, ConfigError, InputError, UserError

__all__ = ["CheckpointError", "ConfigError", "InputError", "UserError"]
