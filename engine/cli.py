"""Entry-point wrapper shared by the engine's and the tools' mains.

Expected failures (UserError) become one line on stderr and exit code 2. In a distributed job
a failure is reported by the rank it happened on, named in the message; a configuration error
found before the process group exists, and an error every rank agreed on (`every_rank`), is
the same on every rank and is printed by rank 0 only, so it reads as one line.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from engine.errors import UserError


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None):
    """Call main(argv) and exit with its code; UserError -> `error: ...`, exit status 2."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        code = main(argv)
    except UserError as err:
        # Only a program that imported torch can have a process group: tools that never need
        # torch (preprocessing) must not pay for importing it here.
        dist = sys.modules.get("torch.distributed")
        started = dist is not None and dist.is_available() and dist.is_initialized()
        if not distributed or (_rank() == 0 and (not started or err.every_rank)):
            print(f"error: {err}", file=sys.stderr, flush=True)
        elif started and not err.every_rank:
            print(f"error: rank {_rank()}: {err}", file=sys.stderr, flush=True)
        if distributed and started:
            os._exit(2)  # peers may be waiting in a collective; do not hang in atexit
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception:  # noqa: BLE001 - a bug or a crash: keep the traceback, name the rank
        if distributed:
            print(f"rank {_rank()} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(1)  # do not wait in atexit handlers for peers that will never answer
        raise
    sys.exit(code or 0)
