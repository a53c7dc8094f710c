"""Entry-point wrapper shared by the engine's and the tools' mains.

Expected failures (UserError) become one line on stderr and exit code 2. In a distributed job
a failure is reported by the rank it happened on, named in the message; a configuration error
found before the process group exists is printed by the first rank of each node (one line on
one machine), and an error every rank agreed on (`every_rank`) by rank 0 only.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from engine.errors import UserError


def _rank(name: str = "RANK") -> int:
    return int(os.environ.get(name, "0"))


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
        # Before the process group, the ranks of a node meet the same problems (their paths,
        # their flags): the first of each node says it. After, rank 0 says what all agreed on,
        # and a rank's own problem is said by that rank.
        first_of_node = _rank("LOCAL_RANK") == 0
        if (
            not distributed
            or (not started and first_of_node)
            or (started and err.every_rank and _rank() == 0)
        ):
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
