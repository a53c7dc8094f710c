"""Everything that only a GPU can show, in one command, with a report to commit.

`make gpu-check` runs this. On a machine with CUDA GPUs it runs each step below in a process
of its own, under its own time limit (a failure or a timeout in one does not stop the others),
and writes docs/gpu/<date>-<device>.md and .json: each step's command, outcome, seconds and
printed tables. Without a GPU it says so in one line and exits 0. `--dry-run` lists the steps,
one a line; `--steps` runs some of them; `--time-scale` shrinks (or stretches) every limit.

A step that needs what the machine lacks (megatron-core for the side-by-side) is listed in the
report as skipped, with the reason. The report also lists what was changed for GPUs since the
last measurements (`TO_CONFIRM`), each beside the outcome of the step that shows it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.config.arguments import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    command: list[str]
    limit_s: int
    needs_module: str | None = None
    needs_gpus: int = 1
    json_name: str | None = None  # the JSON the command writes (under the work folder)


def _tool(name: str, *flags: str) -> list[str]:
    return [sys.executable, os.path.join(TOOLS, name), *flags]


def gpu_test_files() -> list[str]:
    """The test modules with GPU-marked tests (collecting only these keeps the step free of
    the other tests' optional dependencies)."""
    folder = os.path.join(ROOT, "tests")
    return [
        os.path.join("tests", name)
        for name in sorted(os.listdir(folder))
        if name.startswith("test_")
        and name.endswith(".py")
        and "pytest.mark.gpu" in open(os.path.join(folder, name), encoding="utf-8").read()
    ]


def steps() -> list[Step]:
    """The steps, in the order they run (sized for ~25 minutes on one H100)."""
    throughput = []
    for model, variants in (
        ("125m", ["fused", "torch", "fused+compile", "torch+compile"]),
        ("350m", ["fused", "torch"]),
        ("1.3b", ["fused", "torch"]),
        # FP8 against bf16 in the same run (issue 48's goal: >= 1.3x tokens/s on an H100)
        (
            "1.3b",
            ["fused", "fused+fp8", "fused+fp8-delayed", "fused+fp8-blockwise"]
            + ["fused+fp8-torchao"],
        ),
    ):
        name = f"throughput-{model}" + ("-fp8" if any("fp8" in v for v in variants) else "")
        throughput.append(
            Step(
                name,
                f"bench_throughput on the ~{model.upper()} GPT at seq 2048, bf16: "
                + ", ".join(variants),
                _tool(
                    "bench_throughput.py",
                    "--model",
                    model,
                    "--variants",
                    *variants,
                    "--warmup",
                    "2",
                    "--steps",
                    "8",
                    "--json",
                    f"{name}.json",
                ),
                limit_s=600 if name.endswith("fp8") else 300 if model != "125m" else 420,
                json_name=f"{name}.json",
            )
        )
    return [
        Step(
            "environment",
            "the GPU, driver, torch, CUDA, nvcc and ninja",
            _tool("gpu_check.py", "--environment"),
            limit_s=60,
        ),
        Step(
            "gpu-tests",
            "the GPU-marked tests (the CUDA kernels against their references)",
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *gpu_test_files()],
            limit_s=420,
        ),
        Step(
            "fused-ops",
            "each fused kernel against eager PyTorch and torch.compile: parity and speed",
            _tool("bench_fused_ops.py", "--json", "fused-ops.json"),
            limit_s=300,
            json_name="fused-ops.json",
        ),
        Step(
            "attention",
            "the attention kernel each attention path selects",
            _tool("probe_attention.py", "--json", "attention.json"),
            limit_s=120,
            json_name="attention.json",
        ),
        Step(
            "train-launch",
            "the example scripts through torchrun on the GPUs: bf16, --async-save, resume",
            _tool("gpu_train_check.py"),
            limit_s=300,
        ),
        Step(
            "nccl-layouts",
            "TP2, PP2 (every schedule), DP2 (each sharding strategy), CP2 over NCCL on two "
            "GPUs against gloo on CPU",
            _tool("nccl_parity.py", "--json", "nccl-layouts.json"),
            limit_s=720,
            needs_gpus=2,
            json_name="nccl-layouts.json",
        ),
        *throughput,
        Step(
            "vs-megatron",
            "tripod and megatron-core 0.16.1 on the same ~1.3B model and micro-batch",
            _tool(
                "bench_vs_megatron.py",
                *("--model", "1.3b", "--micro-batch-sizes", "8", "4", "2", "1"),
                *("--warmup", "2", "--steps", "8", "--json", "vs-megatron.json"),
            ),
            limit_s=420,
            needs_module="megatron.core",
            json_name="vs-megatron.json",
        ),
    ]


# What was changed for GPUs after the last measurements, tested on the CPU, with the step whose
# outcome shows it on a GPU: the report lists each with that outcome. Everything listed before the
# H100 run of 2026-11-27 was confirmed by it (docs/gpu.md) except what needs two GPUs.
TO_CONFIRM = (
    (
        "pipeline transfers in the planned global order run every schedule over NCCL (2)",
        "nccl-layouts",
    ),
    ("a mixture of experts under DP2 x EP2: the all-to-all over NCCL", "nccl-layouts"),
    (
        "FP8 recipes and torchao's FP8 GEMMs against bf16 (never run on a GPU)",
        "throughput-1.3b-fp8",
    ),
    (
        "the FP8 experts' grouped GEMM (torch._scaled_grouped_mm) against each expert's product",
        "gpu-tests",
    ),
)


def environment() -> int:
    """Print what the machine has (the `environment` step)."""
    import torch

    print(f"python {sys.version.split()[0]}; torch {torch.__version__}; CUDA {torch.version.cuda}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    for tool in ("nvidia-smi", "nvcc", "ninja"):
        print(f"{tool}: {shutil.which(tool) or 'not found'}")
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=name,driver_version,clocks.max.sm,power.limit"
        out = subprocess.run([smi, query, "--format=csv,noheader"], capture_output=True, text=True)
        print(out.stdout.strip())
    return 0


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def run_step(step: Step, work: str, scale: float, left_s: float) -> dict:
    """One step's record: outcome, seconds, output tail, and the JSON it wrote."""
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    record = {"name": step.name, "what": step.what, "command": " ".join(step.command)}
    record["started"] = started
    if left_s < 10:
        return record | {"outcome": "skipped: --deadline-s reached"}
    if step.needs_module and not _has_module(step.needs_module):
        return record | {"outcome": f"skipped: {step.needs_module} is not installed"}
    gpus = _gpu_count()
    if gpus < step.needs_gpus:
        return record | {
            "outcome": f"skipped: needs {step.needs_gpus} GPUs, this machine has {gpus}"
        }
    limit = int(min(max(10, step.limit_s * scale), left_s))
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    start = time.monotonic()
    try:
        done = subprocess.run(
            step.command,
            cwd=work if step.json_name else ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=limit,
        )
        outcome = "ok" if done.returncode == 0 else f"failed (exit code {done.returncode})"
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        outcome = f"timed out after {limit}s"
        output = _text(err.stdout) + _text(err.stderr)
    record |= {"outcome": outcome, "seconds": round(time.monotonic() - start, 1)}
    record["output"] = _tail(output)
    if step.json_name and os.path.exists(os.path.join(work, step.json_name)):
        with open(os.path.join(work, step.json_name)) as f:
            record["result"] = json.load(f)
    return record


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _tail(output: str, lines: int = 40) -> str:
    """The last lines worth reading: warnings and progress noise left out."""
    noise = re.compile(r"USDT:|warnings\.warn|UserWarning|FutureWarning|^\s*$")
    kept = [line for line in output.splitlines() if not noise.search(line)]
    return "\n".join(kept[-lines:])


def report_base(folder: str, device: str) -> str:
    """folder/<date>-<device> (the report's path without .md or .json)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return os.path.join(folder, f"{datetime.date.today().isoformat()}-{slug}")


def earlier_records(base: str) -> list[dict]:
    """The steps of the day's report on this device, if one was written: a rerun of some steps
    replaces theirs and keeps the others."""
    try:
        with open(base + ".json") as f:
            return json.load(f)["steps"]
    except (OSError, ValueError, KeyError):
        return []


def merged(earlier: list[dict], records: list[dict]) -> list[dict]:
    """earlier's records with records' replacing those of the same step, in the steps' order."""
    by_name = {r["name"]: r for r in earlier} | {r["name"]: r for r in records}
    order = [s.name for s in steps()]
    return sorted(
        by_name.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order)
    )


def write_report(records: list[dict], base: str, device: str) -> tuple[str, str]:
    """base.md and base.json; returns their paths."""
    import torch

    os.makedirs(os.path.dirname(base), exist_ok=True)
    date = datetime.date.today().isoformat()
    lines = [
        f"# GPU check: {device}, {date}",
        "",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}; written by `make gpu-check` "
        "(tools/gpu_check.py). Each step ran in its own process under its own time limit.",
        "",
        "| step | outcome | seconds | started (UTC) |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['name']} | {r['outcome']} | {r.get('seconds', '')} | {r.get('started', '')} |"
        for r in records
    ]
    outcome_of = {r["name"]: r["outcome"] for r in records}
    lines += ["", "## To confirm", "", "| changed on the CPU, shown here | step | outcome |"]
    lines += ["| --- | --- | --- |"]
    lines += [f"| {c} | {n} | {outcome_of.get(n, 'not run')} |" for c, n in TO_CONFIRM]
    for r in records:
        lines += ["", f"## {r['name']}", "", r["what"] + ".", "", f"`{r['command']}`", ""]
        lines += [f"Outcome: {r['outcome']}."]
        if r.get("output"):
            lines += ["", "```", r["output"], "```"]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(base + ".json", "w") as f:
        json.dump(
            {"device": device, "date": date, "torch": torch.__version__, "steps": records},
            f,
            indent=1,
        )
    return base + ".md", base + ".json"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="list the steps and stop")
    parser.add_argument("--steps", nargs="+", help="run only these steps (names as listed)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies every limit")
    parser.add_argument("--deadline-s", type=float, default=3600, help="for all steps together")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "gpu"))
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.environment:
        return environment()
    chosen = steps()
    names = [s.name for s in chosen]
    if args.steps:
        unknown = sorted(set(args.steps) - set(names))
        if unknown:
            print(f"gpu_check: --steps: unknown {', '.join(unknown)}; the steps: {' '.join(names)}")
            return 2
        chosen = [s for s in chosen if s.name in args.steps]
    if args.dry_run:
        for s in chosen:
            print(f"{s.name}: {s.what} (limit {s.limit_s}s)")
        for claim, name in TO_CONFIRM:
            print(f"  to confirm by {name}: {claim}")
        return 0
    gpus = _gpu_count()
    if gpus == 0:
        print("gpu_check: no CUDA GPU here; nothing to check (`--dry-run` lists the steps)")
        return 0
    import tempfile

    import torch

    device = torch.cuda.get_device_name(0) + (f" x{gpus}" if gpus > 1 else "")
    base = report_base(args.out, device)
    records, earlier, deadline = [], earlier_records(base), time.monotonic() + args.deadline_s
    with tempfile.TemporaryDirectory() as work:
        for step in chosen:
            print(f"[gpu-check] {step.name}: {step.what}", flush=True)
            record = run_step(step, work, args.time_scale, deadline - time.monotonic())
            print(f"[gpu-check] {step.name}: {record['outcome']} ({record.get('seconds', 0)}s)")
            print(record.get("output", ""), flush=True)
            records.append(record)
            # after every step, so that a kill loses none
            md, js = write_report(merged(earlier, records), base, device)
    print(f"[gpu-check] report: {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
