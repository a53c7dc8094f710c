"""The fault matrix of docs/scale.md: each fault injected into a small run launched as a cluster
launches it (engine.launch on 2 gloo ranks, --max-restarts 1, --load equal to --save, a save
every 2 iterations), and what it cost: how the fault was detected, the seconds from it to its
detection and from there to training again, the iterations trained twice, and whether the
final per-iteration losses equal those of a run without the fault. Prints a table, writes JSON.

    python tools/fault_matrix.py [--only kill-forward,stall-compute] [--json out.json]

The times are read from the output lines as they arrive (the fault's moment is the last line
the failing attempt printed), so they are upper bounds; on this project's 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATIONS = 8
RUN = [
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
    *("--global-batch-size", "4", "--train-iters", str(ITERATIONS), "--lr-warmup-iters", "1"),
    *("--eval-iters", "1", "--eval-interval", "100", "--log-interval", "1"),
    *("--save-interval", "2", "--hang-timeout-seconds", "4", "--rerun-on-nan"),
]
PP2 = ("--pipeline-model-parallel-size", "2")
RUN_LIMIT_S = 300


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    layout: tuple[str, ...]
    env: dict
    flags: tuple[str, ...] = ()
    equal_expected: bool = True  # a poisoned batch is skipped: its run differs by design


FAULTS = [
    Fault("kill-forward", "kill -9 of a rank in forward", PP2,
          {"TRIPOD_FAULT_KILL_AT": "1:5", "TRIPOD_FAULT_KILL_IN": "forward-compute"}),
    Fault("kill-backward", "kill -9 of a rank in backward", PP2,
          {"TRIPOD_FAULT_KILL_AT": "0:5", "TRIPOD_FAULT_KILL_IN": "backward-compute"}),
    Fault("kill-pipeline", "kill -9 of a rank waiting on a pipeline send/receive", PP2,
          {"TRIPOD_FAULT_KILL_AT": "1:5", "TRIPOD_FAULT_KILL_IN": "pipeline-wait"}),
    Fault("kill-save", "kill -9 of a rank during a save", (),
          {"TRIPOD_FAULT_KILL_IN_SAVE": "1:4"}),
    Fault("kill-async-commit", "kill -9 of a rank during an async save's commit", (),
          {"TRIPOD_FAULT_KILL_IN_SAVE": "1:4"}, ("--async-save",)),
    Fault("stall-compute", "a rank stalled in compute (its peer in a DP reduction)", (),
          {"TRIPOD_FAULT_STALL_AT": "1:5"}),
    Fault("stall-pipeline", "a rank stalled (its peer in a pipeline receive)", PP2,
          {"TRIPOD_FAULT_STALL_AT": "0:5"}),
    Fault("transient-nan", "a transient NaN in one rank's gradient", (),
          {"TRIPOD_FAULT_NAN_GRAD_AT": "5"}),
    Fault("poisoned-batch", "a NaN from a poisoned batch (deterministic)", (),
          {"TRIPOD_FAULT_NAN_BATCH_AT": "5"}, equal_expected=False),
    Fault("disk-full", "a full disk during a save (space freed before the restart)", (),
          {"TRIPOD_FAULT_DISK_FULL_IN_SAVE": "1:4"}),
]  # fmt: skip


@dataclass
class Outcome:
    name: str
    what: str
    detected_by: str
    detect_s: float | None
    resume_s: float | None
    iterations_lost: int
    equal: bool
    equal_expected: bool
    exit_code: int
    notes: list[str] = field(default_factory=list)


def _launch(folder: str, layout, env: dict, flags) -> tuple[int, list[tuple[float, str]]]:
    ckpt, log = os.path.join(folder, "ckpt"), os.path.join(folder, "log.jsonl")
    command = [
        *(sys.executable, "-m", "engine.launch", "--standalone", "--nproc-per-node", "2"),
        *("--max-restarts", "1", "-m", "engine.pretrain", *RUN, *layout, *flags),
        *("--save", ckpt, "--load", ckpt, "--log-jsonl", log),
    ]
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    environ |= {"TRIPOD_FAULT_ATTEMPT": "0", "PYTHONPATH": ROOT, **env}
    process = subprocess.Popen(
        command, cwd=ROOT, env=environ, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    stopper = threading.Timer(RUN_LIMIT_S, process.kill)  # a run that never ends is a failure
    stopper.start()
    lines = [(time.monotonic(), line.rstrip("\n")) for line in process.stdout]
    stopper.cancel()
    return process.wait(), lines


def _losses(folder: str) -> dict[int, float]:
    """The last loss logged for each iteration (a restarted run logs some twice)."""
    out = {}
    with open(os.path.join(folder, "log.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if "split" not in record:
                out[record["iteration"]] = record["lm_loss"]
    return out


def _measure(fault: Fault, code: int, lines, losses: dict, reference: dict) -> Outcome:
    text = [line for _, line in lines]
    ended = next((k for k, line in enumerate(text) if line.startswith("attempt 1 ended")), None)
    rerun = next((k for k, line in enumerate(text) if "(--rerun-on-nan)" in line), None)
    equal = losses == reference
    if ended is None:  # handled inside the attempt: a rerun
        by = "--rerun-on-nan" if rerun is not None else "nothing"
        detect = 0.0 if rerun is not None else None
        return Outcome(fault.name, fault.what, by, detect, 0.0, 0, equal,
                       fault.equal_expected, code)  # fmt: skip
    progress = [k for k in range(ended) if re.match(r"(iteration +\d+/|checkpoint saved)", text[k])]
    last = progress[-1] if progress else 0
    hang = any(line.startswith("hang: ") for line in text[:ended])
    by = "hang watchdog (exit 75)" if hang else "the rank's exit (torchrun)"
    if any("the disk is full" in line for line in text[:ended]):
        by = "the save (ENOSPC, exit 2)"
    first_again = next(
        (k for k in range(ended, len(text)) if re.match(r"iteration +\d+/", text[k])), None
    )
    before = [
        int(m.group(1)) for line in text[:ended] if (m := re.match(r"iteration +(\d+)/", line))
    ]
    resumed = next(
        (
            int(m.group(1))
            for line in text[ended:]
            if (m := re.search(r"at iteration (\d+) \(", line))
        ),
        0,
    )
    return Outcome(
        fault.name,
        fault.what,
        by,
        lines[ended][0] - lines[last][0],
        lines[first_again][0] - lines[ended][0] if first_again is not None else None,
        max(before, default=0) - resumed,
        equal,
        fault.equal_expected,
        code,
    )


def run_matrix(names: list[str] | None = None) -> list[Outcome]:
    chosen = [f for f in FAULTS if names is None or f.name in names]
    references: dict[tuple, dict] = {}
    outcomes = []
    with tempfile.TemporaryDirectory() as scratch:
        for fault in chosen:
            key = fault.layout  # (an async save changes no loss: one reference for both)
            if key not in references:
                folder = os.path.join(scratch, f"reference{len(references)}")
                code, lines = _launch(folder, fault.layout, {}, ())
                if code != 0:
                    raise RuntimeError("the reference run failed:\n" + "\n".join(
                        line for _, line in lines[-30:]))  # fmt: skip
                references[key] = _losses(folder)
            folder = os.path.join(scratch, fault.name)
            code, lines = _launch(folder, fault.layout, fault.env, fault.flags)
            outcome = _measure(fault, code, lines, _losses(folder), references[key])
            if code != 0:
                outcome.notes = [line for _, line in lines[-15:]]
            outcomes.append(outcome)
            print(_row(outcome), flush=True)
    return outcomes


HEADER = "| fault | detected by | detect (s) | resume (s) | iterations lost | result equal |"


def _row(o: Outcome) -> str:
    def seconds(value):
        return "-" if value is None else f"{value:.1f}"

    equal = "yes" if o.equal else "no (skipped by design)" if not o.equal_expected else "NO"
    return (
        f"| {o.what} | {o.detected_by} | {seconds(o.detect_s)} | {seconds(o.resume_s)} | "
        f"{o.iterations_lost} | {equal} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated fault names: " + ", ".join(
        f.name for f in FAULTS))  # fmt: skip
    parser.add_argument("--json", help="also write the outcomes here")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else None
    unknown = set(names or []) - {f.name for f in FAULTS}
    if unknown:
        raise ConfigError(f"--only {args.only}: no fault named {sorted(unknown)[0]}")
    print(HEADER)
    print("|" + " --- |" * 6)
    outcomes = run_matrix(names)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=1)
    failed = [o for o in outcomes if o.exit_code != 0 or o.equal != o.equal_expected]
    for o in failed:
        print(f"{o.name}: exit code {o.exit_code}, equal {o.equal}:", *o.notes, sep="\n")
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
