"""What differs between two runs, from their checkpoints' records: the configuration field by
field (every flag as resolved), the flags each command line named, the data files and the code.

    python tools/diff_runs.py SAVE_DIR_A SAVE_DIR_B      (or iter_N folders)
"""

from __future__ import annotations

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.train.run_diff import differences, record_of


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", help="a --save folder (its latest checkpoint) or an iter_N one")
    parser.add_argument("second")
    args = parser.parse_args(argv)
    found = differences(record_of(args.first), record_of(args.second))
    if not found:
        print("the two runs have the same configuration, data files and code")
    for key, first, second in found:
        print(f"{key}: {first!r} | {second!r}")
    return 0


if __name__ == "__main__":
    run_main(main)
