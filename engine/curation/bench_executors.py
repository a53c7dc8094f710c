"""tools/bench_curate.py --executor-documents and --memory-mb: what the executors cost and what
a worker holds.

Executors: the same run of tools/curate.py (the default stages but language ID, exact and
MinHash deduplication, over four JSONL files of real text found here, several tasks per
corpus-wide step) with the local executor, on a Ray cluster it starts on this machine, and on
a Slurm controller and node started here (engine/execution/sandbox_slurm.py; where Slurm and
root are there), each with the same number of CPUs: wall time, the ratio over local, and
whether the kept and removed files are the same bytes. On one machine Ray and Slurm can only
add their overhead (a process per task, scheduling, the launcher's polling): this is what the
table shows; their gain is machines.

Memory: tools/curate.py with one worker on a JSONL file of about `--memory-mb` MB (the local
text repeated, each copy's words shifted so that deduplication keeps it), read in parts of
1,000 documents and in one part of all of them: the peak resident memory of the largest of
the run's processes (getrusage of its children, in a process of its own per run).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

from engine.curation.local_text import local_documents

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES_OFF = {"language": False}  # its model reads the same everywhere; the rest as defaults
PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
    "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _curate(inputs: str, out: str, config: str, *flags: str, env: dict | None = None) -> float:
    command = [sys.executable, os.path.join(ROOT, "tools", "curate.py"), "--input", inputs]
    command += ["--output", out, "--config", config, *flags]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)}: {result.stderr.strip()[-500:]}")
    return time.perf_counter() - start


def _digest(out: str) -> str:
    """One hash of the run's kept and removed files and report, path by path."""
    digest = hashlib.sha256()
    for sub in ("kept", "removed"):
        for root, _, names in sorted(os.walk(os.path.join(out, sub))):
            for name in sorted(names):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, out).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def _write_inputs(documents: list[dict], folder: str, files: int) -> str:
    inputs = os.path.join(folder, "inputs")
    os.makedirs(inputs)
    for k in range(files):
        with open(os.path.join(inputs, f"part-{k}.jsonl"), "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in documents[k::files])
    return inputs


def bench_executors(count: int, workers: int, folder: str) -> dict:
    from engine.execution.sandbox_slurm import SlurmCluster, slurm_available

    documents = local_documents(count)
    inputs = _write_inputs(documents, folder, 4)
    config = os.path.join(folder, "config.json")
    with open(config, "w") as f:
        json.dump(STAGES_OFF, f)
    tasks = ["--dedup-tasks", "4"]
    report = {"documents": len(documents), "workers": workers, "runs": {}}

    def run(name: str, *flags: str, env: dict | None = None) -> None:
        out = os.path.join(folder, name)
        seconds = _curate(inputs, out, config, *tasks, *flags, env=env)
        report["runs"][name] = {"seconds": seconds, "digest": _digest(out)}

    run("local", "--workers", str(workers))
    run("ray", "--executor", "ray", "--workers", str(workers))
    why_not = slurm_available()
    if why_not is None:
        with SlurmCluster() as env:
            run("slurm", "--executor", "slurm", env=env)
    else:
        report["slurm_skipped"] = why_not
    local = report["runs"]["local"]
    for r in report["runs"].values():
        r["over_local"] = r["seconds"] / local["seconds"]
        r["same_files"] = r["digest"] == local["digest"]
    return report


def _large_input(megabytes: float, folder: str) -> tuple[str, int]:
    documents = [d["text"] for d in local_documents(4000)]
    path = os.path.join(folder, "large.jsonl")
    written = count = 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            text = documents[count % len(documents)]
            words = text.split(" ")
            shift = (count // len(documents)) % max(len(words), 1)  # another text each round
            line = json.dumps({"text": " ".join(words[shift:] + words[:shift]), "id": count})
            f.write(line + "\n")
            written += len(line) + 1
            count += 1
    return path, count


def bench_memory(megabytes: float, folder: str) -> dict:
    path, count = _large_input(megabytes, folder)
    report = {"input_mb": os.path.getsize(path) / 1e6, "documents": count, "runs": {}}
    for per_part in (1000, count):
        config = os.path.join(folder, f"memory-{per_part}.json")
        with open(config, "w") as f:
            json.dump({**STAGES_OFF, "documents_per_part": per_part}, f)
        command = [sys.executable, os.path.join(ROOT, "tools", "curate.py"), "--input", path,
                   "--output", os.path.join(folder, f"memory-{per_part}"), "--config", config,
                   "--workers", "1"]  # fmt: skip
        result = subprocess.run([sys.executable, "-c", PEAK_RSS, *command], capture_output=True,
                                text=True, cwd=ROOT, check=True)  # fmt: skip
        peak_mb = int(result.stdout.strip().splitlines()[-1]) / 1024
        report["runs"][per_part] = {"peak_mb": peak_mb}
    return report
