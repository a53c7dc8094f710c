"""Which test files run alone: reads the per-test log a suite run writes under
TRIPOD_TEST_CPU_LOG=<file> (tests/conftest.py: each test's wall time and the machine's busy CPU
seconds meanwhile, taken with the suite run on one worker and nothing else on the machine) and
prints each file's wall time, busy time, the cores it kept busy and the most any test of a
second or more kept busy. Files that kept at most --cores busy, on average and in each such
test (a file's average hides a test whose ranks fill the machine), share `make test`'s
workers; --write lists them in tests/shared_files.txt. Every other file, a new one included
until it is measured, runs in the serial part, one at a time after the shared part.

  TEST_WORKERS=1 TRIPOD_TEST_CPU_LOG=/tmp/cpu.jsonl make test
  python tools/test_lanes.py /tmp/cpu.jsonl --write
"""

from __future__ import annotations

import argparse
import collections
import json
import os

from engine.cli import run_main
from parallel.errors import UserError

LONG_TEST_S = 1.0  # a shorter test's ratio is mostly noise of the clock ticks
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_FILES = os.path.join(REPOSITORY, "tests", "shared_files.txt")


def shared_files(path: str = SHARED_FILES) -> frozenset[str]:
    """The file names --write listed (tests/conftest.py marks every other file `serial`)."""
    with open(path) as f:
        return frozenset(line.strip() for line in f if line.strip() and not line.startswith("#"))


def file_times(log: str) -> dict[str, tuple[float, float, float]]:
    """{test file: (wall seconds, busy CPU seconds, peak cores)}: the first two summed over its
    tests, the last the most cores any test of LONG_TEST_S or more kept busy."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    with open(log) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                name = os.path.basename(record["test"].split("::")[0])
                wall, busy = float(record["wall_s"]), float(record["busy_s"])
                totals[name][0] += wall
                totals[name][1] += busy
                if wall >= LONG_TEST_S:
                    totals[name][2] = max(totals[name][2], busy / wall)
            except (ValueError, KeyError, TypeError) as error:
                raise UserError(
                    f"{log}: line {number} is not a test record ({error}); give the file "
                    "TRIPOD_TEST_CPU_LOG wrote"
                ) from None
    return {name: (wall, busy, peak) for name, (wall, busy, peak) in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the JSON lines TRIPOD_TEST_CPU_LOG wrote")
    parser.add_argument("--cores", type=float, default=1.3, help="shared up to this many")
    parser.add_argument("--write", action="store_true", help="rewrite --output")
    parser.add_argument("--output", default=SHARED_FILES, help="the list --write rewrites")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.log):
        raise UserError(f"{args.log}: no such file; run the suite with TRIPOD_TEST_CPU_LOG first")
    times = file_times(args.log)
    shared = sorted(
        name
        for name, (wall, busy, peak) in times.items()
        if busy <= args.cores * wall and peak <= args.cores
    )
    print(f"{'file':48s} {'wall s':>8s} {'busy s':>8s} {'cores':>6s} {'peak':>6s}  part")
    for name, (wall, busy, peak) in sorted(times.items(), key=lambda item: -item[1][0]):
        part = "shared" if name in shared else "serial"
        cores = busy / max(wall, 1e-9)
        print(f"{name:48s} {wall:8.1f} {busy:8.1f} {cores:6.2f} {peak:6.2f}  {part}")
    for part, names in (("shared", shared), ("serial", sorted(set(times) - set(shared)))):
        wall = sum(times[name][0] for name in names)
        print(f"{part}: {len(names)} files, {wall / 60:.1f} min one at a time")
    if args.write:
        with open(args.output, "w") as f:
            f.write("# Test files measured to keep one core busy (tools/test_lanes.py --write):\n")
            f.write("# `make test` shares them among its workers; the others run one at a time.\n")
            f.writelines(f"{name}\n" for name in shared)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run_main(main)
