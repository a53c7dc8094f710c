"""A checkpoint's files are checked before anything is loaded from them: every file is listed
in meta.json with the size and xxh3 checksum it was written with, so a flipped byte, a
truncated or missing shard and a missing `.metadata` are each one line naming the file (exit
code 2) in training and in the converter; --no-verify skips the checksums. Saving: a --save
path that cannot be written is found at start, and a full disk during a save says so, removes
the unfinished folder and keeps the previous checkpoint as the latest."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from engine.checkpoint.files import META, iteration_dir, read_meta
from parallel.checkpoint.checksums import file_digest
from tests.cli import one_line_error, run_python, run_tool
from tests.small_disk import run_on_small_disk, small_disk_available


def train_args(dataset_prefix, tokenizer_model, *extra) -> list[str]:
    """The flags of the `small_checkpoint` fixture's run (tests/conftest.py), plus `extra`."""
    return [
        *("--data-path", dataset_prefix, "--tokenizer-model", tokenizer_model),
        *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
        *("--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2"),
        *("--global-batch-size", "4"),
        *("--lr-warmup-iters", "1", "--split", "90,10,0", "--eval-iters", "1"),
        *("--make-vocab-size-divisible-by", "16", "--log-interval", "1"),
        *extra,
    ]


def resume(dataset_prefix, tokenizer_model, ckpt: str, *extra: str):
    """Three iterations of the fixture's run, resumed from `ckpt` (a longer run: its schedule
    differs from the checkpoint's, which Megatron-LM's flag accepts)."""
    args = train_args(dataset_prefix, tokenizer_model, "--train-iters", "3", "--load", ckpt)
    args.append("--override-opt_param-scheduler")
    return run_python("-m", "engine.pretrain", *args, *extra)


def test_every_file_is_listed_with_its_size_and_checksum(small_checkpoint):
    folder = iteration_dir(small_checkpoint, 2)
    meta = read_meta(folder)
    on_disk = sorted(n for n in os.listdir(folder) if n != META)
    assert sorted(meta["files"]) == on_disk and ".metadata" in on_disk
    for name, record in meta["files"].items():
        path = os.path.join(folder, name)
        assert record == {"bytes": os.path.getsize(path), "xxh3_64": file_digest(path)}


def _flip_middle_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        value = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([value ^ 0x40]))


def _damage(kind: str, folder: str) -> str:
    """Damage the checkpoint folder; returns the file the error must name."""
    shard = os.path.join(folder, "__0_0.distcp")
    if kind == "flipped byte":
        _flip_middle_byte(shard)
    elif kind == "truncated shard":
        os.truncate(shard, os.path.getsize(shard) // 3)
    elif kind == "missing shard":
        os.remove(shard)
    elif kind == "missing .metadata":
        os.remove(os.path.join(folder, ".metadata"))
        return os.path.join(folder, ".metadata")
    elif kind == "edited meta.json":
        path = os.path.join(folder, META)
        with open(path) as f:
            meta = json.load(f)
        meta["consumed_samples"] += 4
        with open(path, "w") as f:
            json.dump(meta, f)
        return path
    return shard


EXPECTED = {
    "flipped byte": "checksum mismatch, the file is damaged",
    "truncated shard": "were written; the file is truncated or damaged",
    "missing shard": "missing (the checkpoint lists it)",
    "missing .metadata": "missing (the checkpoint lists it)",
    "edited meta.json": "damaged (its content does not match its checksum)",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_damage_is_one_line_naming_the_file(
    kind, small_checkpoint, dataset_prefix, tokenizer_model, tmp_path
):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(small_checkpoint, ckpt)
    named = _damage(kind, iteration_dir(ckpt, 2))
    hf = str(tmp_path / "hf")
    results = {
        "training": resume(dataset_prefix, tokenizer_model, ckpt),
        "converter": run_tool("convert_checkpoint.py", "--load", ckpt, "--output", hf),
    }
    for where, result in results.items():
        line = one_line_error(result)
        assert line.startswith(f"error: {named}") and EXPECTED[kind] in line, (where, line)
        assert "iteration " not in result.stdout, where
    assert not os.path.exists(hf)


def test_no_verify_loads_a_checkpoint_whose_checksum_differs(
    small_checkpoint, dataset_prefix, tokenizer_model, tmp_path
):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(small_checkpoint, ckpt)
    _flip_middle_byte(os.path.join(iteration_dir(ckpt, 2), "__0_0.distcp"))
    result = resume(dataset_prefix, tokenizer_model, ckpt, "--no-verify")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checksums not compared (--no-verify)" in result.stdout
    assert "iteration      3/3" in result.stdout


def test_unwritable_save_path_is_found_at_start(dataset_prefix, tokenizer_model, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cases = [
        ("--save", str(a_file / "ckpt"), "a file stands where a folder is needed"),
        ("--save", "/proc/tripod-test/ckpt", "cannot be created there"),
        ("--tensorboard-dir", str(a_file / "tb"), "a file stands where a folder is needed"),
        ("--log-jsonl", str(a_file / "log.jsonl"), "a file stands where a folder is needed"),
    ]
    for flag, path, message in cases:
        args = train_args(dataset_prefix, tokenizer_model, "--train-iters", "2", flag, path)
        result = run_python("-m", "engine.pretrain", *args)
        line = one_line_error(result)
        assert line.startswith(f"error: {flag}") and message in line, line
        assert "iteration " not in result.stdout


def test_read_only_save_path_is_found_at_start(dataset_prefix, tokenizer_model, tmp_path):
    """A real read-only file system (root writes anywhere else, so chmod would not do)."""
    if not small_disk_available():
        pytest.skip("no mount namespaces here (unshare) for a read-only tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    args = train_args(dataset_prefix, tokenizer_model, "--train-iters", "2")
    command = [sys.executable, "-m", "engine.pretrain", *args, "--save", str(disk / "ckpt")]
    result = run_on_small_disk(disk, "64k,ro", command)
    line = one_line_error(result)
    assert line == (
        f"error: --save: {disk / 'ckpt'}: not writable (Read-only file system); pick a "
        "location you can write to"
    )
    assert "iteration " not in result.stdout


_DISK_FULL_SCENARIO = """
import json, os, subprocess, sys
command, ckpt = json.loads(sys.argv[1]), sys.argv[2]
done = subprocess.run(command, capture_output=True, text=True)
names = sorted(os.listdir(ckpt))
latest = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()
print(json.dumps({"code": done.returncode, "stderr": done.stderr, "stdout": done.stdout,
                  "names": names, "latest": latest}))
"""


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks-async-launcher"])
def test_full_disk_during_a_save(ranks, dataset_prefix, tokenizer_model, tmp_path):
    """A real full disk: a tmpfs that holds one checkpoint of this model (1.3 MB) but not two.
    One rank saving synchronously; two ranks through the launcher with --async-save, where the
    failure is found in the background thread, agreed by both ranks and printed once."""
    if not small_disk_available():
        pytest.skip("no mount namespaces here (unshare) for a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    ckpt = str(disk / "ckpt")
    args = train_args(
        dataset_prefix,
        tokenizer_model,
        "--train-iters",
        "4",
        "--save",
        ckpt,
        "--save-interval",
        "2",
    )
    command = [sys.executable, "-m", "engine.pretrain", *args]
    if ranks == 2:
        command = [
            sys.executable,
            "-m",
            "engine.launch",
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "engine.pretrain",
            *args,
            "--async-save",
        ]
    scenario = [sys.executable, "-c", _DISK_FULL_SCENARIO, json.dumps(command), ckpt]
    done = run_on_small_disk(disk, "1900k", scenario)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    lines = seen["stderr"].strip().splitlines()
    assert seen["code"] == 2 and len(lines) == 1, seen["stderr"][-3000:]
    assert "saving the checkpoint of iteration 4" in lines[0]
    assert f"{ckpt}: the disk is full" in lines[0]
    assert "iteration 2 stays the latest checkpoint" in lines[0]
    assert "iteration      4/4" in seen["stdout"]
    # (and the lock of the run that held the folder: engine/checkpoint/run_lock.py)
    assert seen["names"] == [".run.lock", "iter_0000002", "latest_checkpointed_iteration.txt"]
    assert seen["latest"] == "2"
