"""Errors meant for people: each carries one line that names the file or flag and the fix.

Command-line front doors catch `UserError`, print its message and exit with code 2
(see engine/cli.py); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """An expected failure caused by input, configuration or environment.

    every_rank=True says that every rank of a distributed job raises this same error at the
    same point (it was agreed on collectively), so only rank 0 needs to print it."""

    def __init__(self, message: str = "", *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class InputError(UserError, ValueError):
    """Bad input data: a malformed record, a missing column, an unreadable file."""


class ConfigError(UserError, ValueError):
    """An invalid or contradictory configuration (flags, model shape, parallel layout)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete, damaged or belongs to a different model."""


def describe_os_error(
    err: OSError, path: str | os.PathLike | None = None, writing: bool = False
) -> str:
    """One line for an OSError met while reading or (`writing`) writing `path`: what went wrong
    there and what to do. A full disk and a read-only or forbidden place are named as such."""
    where = os.fspath(path) if path is not None else (err.filename or "a file")
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{where}: the disk is full ({reason}); free space there or write elsewhere"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{where}: not writable ({reason}); pick a location you can write to"
    if err.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"{where}: a file stands where a folder is needed ({reason}); pick another path"
    if err.errno == errno.ENOENT and writing:  # its folder cannot be made (e.g. under /proc)
        return f"{where}: cannot be created there ({reason}); pick a path you can write to"
    if err.errno == errno.ENOENT:
        return f"{where}: no such file or folder ({reason})"
    return f"{where}: {reason}"


def one_line(err: BaseException) -> str:
    """`Type: first line of the message` of an exception."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def root_cause(err: BaseException) -> BaseException:
    """The exception behind wrappers: torch.distributed.checkpoint's CheckpointException
    (whose `failures` maps each failed rank to (exception, traceback)) and chains of causes.
    Stops at the first OSError or UserError, which say what happened in the user's terms."""
    seen = set()
    while id(err) not in seen and not isinstance(err, OSError | UserError):
        seen.add(id(err))
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict) and failures:
            err = next(iter(failures.values()))[0]
        elif err.__cause__ is not None:
            err = err.__cause__
        else:
            break
    return err
