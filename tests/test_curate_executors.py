"""tools/curate.py's executors: the whole pipeline (web stages, rules, exact, MinHash and line
deduplication, perplexity buckets, PII) on a small crawl gives the same files, byte for byte,
in one local process with one partition, in two processes with three partitions and a task
killed mid-stage, on a real Ray cluster (a head and a worker node started on loopback) and on
a real Slurm (a controller and a node on this machine) with a task killed and resubmitted.
The distributed MinHash stages equal engine/curation/minhash.py's single-process clusters."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from engine.curation import minhash
from engine.curation.local_text import local_documents
from engine.curation.minhash import MinHashConfig
from engine.curation.planted import planted_corpus
from engine.curation.web.sample_crawl import write_sample_blocklists, write_sample_crawl
from engine.execution.sandbox_slurm import SlurmCluster, slurm_available
from tests.cli import one_line_error, run_python, run_tool
from tests.requirements import require


def _near_copies(count: int, seed: int = 0) -> list[dict]:
    """Prose documents and copies of every third with about 1% of the words changed and a
    line added (as the issue's planted duplicates)."""
    rng = random.Random(seed)
    prose = [d["text"] for d in local_documents(1500) if d["source"].startswith("docstring:")]
    prose = [t for t in prose if len(t.split()) >= 150][:count]
    rows = []
    for i, text in enumerate(prose):
        rows.append({"text": text, "id": f"doc{i}"})
        if i % 3 == 0:
            words = text.split(" ")
            for j in rng.sample(range(len(words)), max(1, len(words) // 100)):
                words[j] = "changed"
            rows.append({"text": " ".join(words) + "\nA short line added here.", "id": f"copy{i}"})
    return rows


@pytest.fixture(scope="module")
def crawl_run(tmp_path_factory, small_checkpoint):
    """A crawl (two WARC files) and a JSONL file of prose with near copies, and a config with
    every kind of stage on (small parts: shards of several parts)."""
    folder = tmp_path_factory.mktemp("executors")
    write_sample_crawl(str(folder / "raw"), pages=24, files=2)
    lists = write_sample_blocklists(str(folder / "lists"))
    with open(folder / "raw" / "prose.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in _near_copies(18))
    config = {
        "documents_per_part": 7,
        "url_filter": {"blocklists": [lists]},
        "language": {"languages": ["en"], "min_score": 0.5},
        "gopher_repetition": False, "gopher_quality": False, "c4": False, "fineweb": False,
        "exact_dedup": {"documents": True, "lines": True},
        "minhash": {"num_perm": 16, "threshold": 0.7},  # 8 bands: few Slurm array tasks
        "perplexity": {"model": small_checkpoint, "max_tokens": 16},
    }  # fmt: skip
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    reference = folder / "reference"
    result = _curate(folder, reference, "--dedup-tasks", "1")
    assert result.returncode == 0, result.stderr
    return {"folder": folder, "reference": reference}


def _curate(folder, out, *extra, env=None):
    args = ["tools/curate.py", "--input", str(folder / "raw"), "--output", str(out),
            "--config", str(folder / "config.json"), *extra]  # fmt: skip
    return run_python(*args, env=env, timeout=600)


def _files(out) -> dict[str, bytes]:
    """Every output file (kept, removed, the report's numbers) by its path in the run."""
    files = {}
    for sub in ("kept", "removed"):
        for root, _, names in os.walk(out / sub):
            for name in names:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    files[os.path.relpath(path, out)] = f.read()
    report = json.loads((out / "report.json").read_text())
    files["report"] = json.dumps(report, sort_keys=True).encode()
    return files


def test_the_reference_run_exercises_every_stage(crawl_run):
    report = json.loads((crawl_run["reference"] / "report.json").read_text())
    removed = report["removed"]
    for stage in ("url_filter", "exact_dedup", "minhash", "perplexity"):
        assert stage in removed, removed
    assert report["perplexity_cutoffs"]["en"][0] is not None
    done = os.listdir(crawl_run["reference"] / "work" / "done")
    for stage in ("first", "exact", "bands", "clusters", "lines", "decide", "score", "cutoffs",
                  "final"):  # fmt: skip
        assert any(n.startswith(stage + "-") for n in done), stage


def test_local_workers_partitions_and_a_killed_task_give_the_same_files(crawl_run, tmp_path):
    out, flag = tmp_path / "out", tmp_path / "killed-once"
    env = {"TRIPOD_FAULT_KILL_TASK": f"bands:2:{flag}"}
    result = _curate(crawl_run["folder"], out, "--workers", "2", "--dedup-tasks", "3", env=env)
    assert result.returncode == 0, result.stderr
    assert flag.exists()  # the task was killed once, then run again
    assert _files(out) == _files(crawl_run["reference"])


def test_distributed_minhash_equals_single_process_clusters(tmp_path):
    """Only MinHash on: the documents removed are those whose cluster (minhash.duplicate_of on
    every signature in one process) has an earlier member, with 4 partitions."""
    corpus = planted_corpus(40, (0.95, 0.85, 0.75, 0.6), words_per_doc=300)
    raw = tmp_path / "raw"
    raw.mkdir()
    for k in range(3):  # three shards
        with open(raw / f"p{k}.jsonl", "w") as f:
            for i in range(k, len(corpus.texts), 3):
                f.write(json.dumps({"text": corpus.texts[i], "i": i}) + "\n")
    stages = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "exact_dedup",
              "pii")  # fmt: skip
    off = dict.fromkeys(stages, False)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({**off, "minhash": {"threshold": 0.8},
                                  "documents_per_part": 11}))  # fmt: skip
    out = tmp_path / "out"
    result = run_tool("curate.py", "--input", str(raw), "--output", str(out), "--config",
                      str(config), "--dedup-tasks", "4", "--workers", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    import pyarrow.parquet as pq

    removed = {r["i"] for f in sorted((out / "removed").glob("*.parquet"))
               for r in pq.read_table(f).to_pylist()}  # fmt: skip
    order = [i for k in range(3) for i in range(k, len(corpus.texts), 3)]  # corpus order
    params = MinHashConfig(threshold=0.8)
    first = minhash.duplicate_of(minhash.signatures([corpus.texts[i] for i in order], params),
                                 params)  # fmt: skip
    expected = {order[j] for j in range(len(order)) if first[j] != j}
    assert removed == expected and len(expected) > 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_cluster_on_loopback_gives_the_same_files(crawl_run, tmp_path):
    require("ray")
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # its sockets' paths must stay short
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    head = [ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
            "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}"]  # fmt: skip
    worker = [ray, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1",
              "--num-cpus=1"]  # fmt: skip
    try:
        for command in (head, worker):
            started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            assert started.returncode == 0, started.stderr[-2000:]
        out, flag = tmp_path / "out", tmp_path / "killed-once"
        fault = {"TRIPOD_FAULT_KILL_TASK": f"first:1:{flag}"}
        result = _curate(crawl_run["folder"], out, "--executor", "ray", "--ray-address",
                         f"127.0.0.1:{port}", "--dedup-tasks", "2", env=fault)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert flag.exists()  # Ray ran the killed task again
        assert _files(out) == _files(crawl_run["reference"])
        nodes = subprocess.run([ray, "status", f"--address=127.0.0.1:{port}"], env=env,
                               capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        assert nodes.count("node_") >= 2, nodes  # a head and a worker
        # bad input met by a task on the cluster: one line, as on this machine
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "fine"}\nnot json\n')
        result = run_tool("curate.py", "--input", str(bad), "--output", str(tmp_path / "b"),
                          "--executor", "ray", "--ray-address", f"127.0.0.1:{port}")  # fmt: skip
        assert f"{bad}:line 2: not a JSON object" in one_line_error(result)
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def test_an_unreachable_ray_address_is_one_line(crawl_run, tmp_path):
    port = _free_port()  # nothing listens there
    out = tmp_path / "out"
    result = _curate(crawl_run["folder"], out, "--executor", "ray", "--ray-address",
                     f"127.0.0.1:{port}")  # fmt: skip
    assert f"--ray-address 127.0.0.1:{port}: nothing answers there" in one_line_error(result)
    assert not out.exists()


@pytest.mark.skipif(slurm_available() is not None, reason=f"Slurm: {slurm_available()}")
def test_slurm_job_arrays_give_the_same_files(crawl_run, tmp_path):
    with SlurmCluster() as env:
        refused = tmp_path / "refused"
        result = _curate(crawl_run["folder"], refused, "--executor", "slurm",
                         "--slurm-partition", "nowhere", env=env)  # fmt: skip
        line = one_line_error(result)
        assert "--executor slurm: sbatch refused the first array" in line, line
        assert not list((refused / "kept").iterdir())
        out, flag = tmp_path / "out", tmp_path / "killed-once"
        fault = dict(env, TRIPOD_FAULT_KILL_TASK=f"decide:1:{flag}")
        result = _curate(crawl_run["folder"], out, "--executor", "slurm", "--dedup-tasks", "1",
                         env=fault)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert flag.exists()  # the killed array task was submitted again
        assert _files(out) == _files(crawl_run["reference"])
        logs = os.listdir(out / "work" / "logs")
        assert "decide-1.log" in logs and "first-0.log" in logs


def test_executor_flags_are_checked_in_one_line(crawl_run, tmp_path):
    cases = [
        (["--ray-address", "127.0.0.1:1"], "--ray-address: only with --executor ray"),
        (["--slurm-partition", "cpu"], "--slurm-partition: only with --executor slurm"),
        (["--dedup-tasks", "0"], "--dedup-tasks 0: give at least 1"),
        (["--max-retries", "-1"], "--max-retries -1: give 0 or more"),
        (["--executor", "ray", "--ray-address", "nohost"], "give host:port"),
    ]
    for extra, message in cases:
        assert message in one_line_error(_curate(crawl_run["folder"], tmp_path / "o", *extra))
    assert not (tmp_path / "o").exists()
    # another --dedup-tasks in a finished run's folder is another run
    line = one_line_error(_curate(crawl_run["folder"], crawl_run["reference"], "--dedup-tasks",
                                  "2"))  # fmt: skip
    assert "another --dedup-tasks" in line
