"""Shared fixtures: the built-in corpus, a small tokenizer trained on it, and its dataset; every
test's random streams seeded from its name."""

from __future__ import annotations

import os

import pytest

from engine.data.prepare.corpus import write_corpus
from engine.data.prepare.preprocess import preprocess
from engine.data.tokenizers.train_sentencepiece import train_tokenizer

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _rank_server():
    """Before any test (and the data fixtures' preprocessing pools) starts this process's
    forkserver: the one its ranks are forked from, with torch and the engine imported."""
    from tests.distributed import start_rank_server

    start_rank_server()


@pytest.fixture(autouse=True)
def _seeded_random_streams(request):
    """Every test starts its random streams (torch, numpy, random) from a seed of its own name,
    so an input drawn without a generator is the same whichever tests ran before it. (Ranks
    started by tests/distributed.py are fresh processes: torch's default seed is fixed.)"""
    import random
    import zlib

    import numpy as np
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, str]:
    """The built-in corpus (about 1 MB of it): {'jsonl': path, 'parquet': path}."""
    return write_corpus(tmp_path_factory.mktemp("corpus"), max_bytes=1_000_000)


@pytest.fixture(scope="session")
def tokenizer_model(corpus, tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("tokenizer") / "tok"
    train_tokenizer([corpus["jsonl"]], str(prefix), vocab_size=2000)
    return f"{prefix}.model"


@pytest.fixture(scope="session")
def dataset_prefix(corpus, tokenizer_model, tmp_path_factory) -> str:
    """The corpus preprocessed with --append-eod: <dir>/data_text_document."""
    out = tmp_path_factory.mktemp("dataset") / "data"
    preprocess(corpus["jsonl"], str(out), tokenizer_model, append_eod=True, progress=False)
    return f"{out}_text_document"


def _train_and_save(rank, world, argv):
    from engine.pretrain import main

    return main(argv)


@pytest.fixture(scope="session")
def small_checkpoint(dataset_prefix, tokenizer_model, tmp_path_factory) -> str:
    """A checkpoint folder (2 iterations of a tiny GPT, one rank) written by the engine; copy
    it before damaging it."""
    from tests.distributed import run_ranks

    root = str(tmp_path_factory.mktemp("small_checkpoint") / "ckpt")
    argv = [
        *("--data-path", dataset_prefix, "--tokenizer-model", tokenizer_model),
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
        *("--global-batch-size", "4"),
        *("--train-iters", "2", "--lr-warmup-iters", "1", "--split", "90,10,0"),
        *("--eval-iters", "1", "--make-vocab-size-divisible-by", "16", "--save", root),
    ]
    run_ranks(_train_and_save, 1, argv)
    return root


@pytest.fixture(scope="session")
def small_checkpoint_hf(small_checkpoint, tmp_path_factory) -> str:
    """small_checkpoint exported to a Hugging Face folder by tools/convert_checkpoint.py."""
    import subprocess
    import sys

    folder = str(tmp_path_factory.mktemp("small_checkpoint_hf") / "hf")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "tools/convert_checkpoint.py", "--load", small_checkpoint]
    result = subprocess.run(
        [*command, "--output", folder], capture_output=True, text=True, cwd=root,
        env=dict(os.environ, PYTHONPATH=root), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return folder


def pytest_collection_modifyitems(config, items):
    """Every test but those tests/shared_files.txt lists (whole files, or `file::function`:
    measured to keep one core busy, tools/test_lanes.py) is marked `serial`: `make test` shares
    the listed ones among its workers, then runs the others one at a time. Their ranks fill the
    machine's cores, and two such tests side by side take longer than one after the other
    (docs/testing.md)."""
    from tools.test_lanes import is_shared, shared_files

    shared = shared_files()
    for item in items:
        function = getattr(item, "originalname", None) or item.name.split("[")[0]
        if not is_shared(shared, os.path.basename(str(item.path)), function):
            item.add_marker(pytest.mark.serial)


# Under CI (`.ci/run` sets TRIPOD_FAIL_ON_SKIP=1) a skip is a failure unless it is for a GPU,
# which CI machines do not have: a missing tool or environment must not pass for a green run.
_GPU_SKIP_WORDS = ("CUDA", "GPU", "nvcc")


def _skipped_not_for_a_gpu(session) -> list[str]:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    out = []
    for report in reporter.stats.get("skipped", []) if reporter else []:
        longrepr = report.longrepr
        reason = longrepr[-1] if isinstance(longrepr, tuple) else str(longrepr)
        if not any(word in reason for word in _GPU_SKIP_WORDS):
            out.append(f"{report.nodeid}: {reason}")
    return out


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("TRIPOD_FAIL_ON_SKIP") != "1" or exitstatus != 0:
        return
    skipped = _skipped_not_for_a_gpu(session)
    if skipped:
        print("\nskipped for a reason other than a GPU (TRIPOD_FAIL_ON_SKIP=1 fails them):")
        for line in skipped:
            print(f"  {line}")
        session.exitstatus = 1


def _machine_busy_seconds() -> float:
    """CPU seconds this machine has spent busy, all cores and processes (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With TRIPOD_TEST_CPU_LOG=<file>: one JSON line per test with its wall time and the
    machine's busy CPU seconds meanwhile (run alone, their ratio is the cores the test kept
    busy: how the suite's test files are split between its parallel and serial parts)."""
    path = os.environ.get("TRIPOD_TEST_CPU_LOG")
    if not path or not os.path.exists("/proc/stat"):
        yield
        return
    import json
    import time

    wall, busy = time.monotonic(), _machine_busy_seconds()
    yield
    record = {
        "test": item.nodeid,
        "wall_s": round(time.monotonic() - wall, 2),
        "busy_s": round(_machine_busy_seconds() - busy, 2),
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
