"""Which tests run alone: reads the per-test log a suite run writes under
TRIPOD_TEST_CPU_LOG=<file> (tests/conftest.py: each test's wall time and the machine's busy CPU
seconds meanwhile, taken with the suite run on one worker and nothing else on the machine) and
prints each file's wall time, busy time, the cores it kept busy and the most any test of a
second or more kept busy. Files that kept at most --cores busy, on average and in each such
test (a file's average hides a test whose ranks fill the machine), share `make test`'s
workers; --write lists them in tests/shared_files.txt. In the other files, each test function
that kept at most --cores busy in the same way (all its parameter sets together) is listed as
`file::function` and shares the workers too, unless the file has module- or class-scoped
fixtures (which both parts would build). Everything else, a new file or a new function
of a file not listed whole included until it is measured, runs in the serial part, one at a
time after the shared part. --merge keeps the lines of files the log does not cover.

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
    """The file names and `file::function`s --write listed (tests/conftest.py marks every other
    test `serial`)."""
    with open(path) as f:
        return frozenset(line.strip() for line in f if line.strip() and not line.startswith("#"))


def is_shared(listed: frozenset[str], file_name: str, function: str) -> bool:
    return file_name in listed or f"{file_name}::{function}" in listed


def file_times(log: str, functions: bool = False) -> dict[str, tuple[float, float, float]]:
    """{test file (or `file::function`): (wall seconds, busy CPU seconds, peak cores)}: the
    first two summed over its tests, the last the most cores any test of LONG_TEST_S or more
    kept busy."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    with open(log) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                path, _, test = record["test"].partition("::")
                name = os.path.basename(path)
                if functions:
                    name = f"{name}::{test.split('[')[0]}"
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


def _has_wide_fixtures(file_name: str) -> bool:
    """Whether tests/<file_name> defines a module- or class-scoped fixture (its tests then stay
    together: split between the parts, the fixture would be built in each)."""
    path = os.path.join(REPOSITORY, "tests", file_name)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return any(f'scope="{scope}"' in text for scope in ("module", "class", "package"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the JSON lines TRIPOD_TEST_CPU_LOG wrote")
    parser.add_argument("--cores", type=float, default=1.3, help="shared up to this many")
    parser.add_argument("--write", action="store_true", help="rewrite --output")
    parser.add_argument("--output", default=SHARED_FILES, help="the list --write rewrites")
    parser.add_argument(
        "--merge", action="store_true", help="keep --output's lines of files the log lacks"
    )
    args = parser.parse_args(argv)
    if not os.path.isfile(args.log):
        raise UserError(f"{args.log}: no such file; run the suite with TRIPOD_TEST_CPU_LOG first")
    times = file_times(args.log)

    def one_core(stats) -> bool:
        wall, busy, peak = stats
        return busy <= args.cores * wall and peak <= args.cores

    shared = sorted(name for name, stats in times.items() if one_core(stats))
    function_times = file_times(args.log, functions=True)
    functions = sorted(
        name
        for name, stats in function_times.items()
        if name.split("::")[0] not in shared and one_core(stats)
        and not _has_wide_fixtures(name.split("::")[0])
    )  # fmt: skip
    kept = []
    if args.merge and os.path.isfile(args.output):
        kept = [line for line in shared_files(args.output) if line.split("::")[0] not in times]
    print(f"{'file':48s} {'wall s':>8s} {'busy s':>8s} {'cores':>6s} {'peak':>6s}  part")
    for name, (wall, busy, peak) in sorted(times.items(), key=lambda item: -item[1][0]):
        part = "shared" if name in shared else "serial"
        cores = busy / max(wall, 1e-9)
        print(f"{name:48s} {wall:8.1f} {busy:8.1f} {cores:6.2f} {peak:6.2f}  {part}")
    for part, names in (("shared", shared), ("serial", sorted(set(times) - set(shared)))):
        wall = sum(times[name][0] for name in names)
        print(f"{part}: {len(names)} files, {wall / 60:.1f} min one at a time")
    if functions:
        wall = sum(function_times[name][0] for name in functions)
        print(f"and {len(functions)} functions of the serial files, {wall / 60:.1f} min, shared")
    if args.write:
        with open(args.output, "w") as f:
            f.write("# Test files (and file::function) measured to keep one core busy\n")
            f.write("# (tools/test_lanes.py --write): `make test` shares them among its\n")
            f.write("# workers; every other test runs one at a time.\n")
            f.writelines(f"{name}\n" for name in sorted({*shared, *functions, *kept}))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run_main(main)
