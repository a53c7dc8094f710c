"""One task of a curation run, as a Slurm array task runs it:

python -m engine.curation.executors.task_main --output curated/ --stage first --index 3
"""

from __future__ import annotations

import argparse

from engine.cli import run_main
from engine.curation.tasks import run_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    run_task(args.output, args.stage, args.index)
    return 0


if __name__ == "__main__":
    run_main(main)
