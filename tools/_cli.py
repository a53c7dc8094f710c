"""Shared entry-point wrapper: expected failures become one line on stderr and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from engine.errors import UserError


def run(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """Call main(argv); a UserError prints `error: <message>` and exits with status 2."""
    try:
        code = main(argv)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
