"""The 22 Megatron-LM commands of tools/megatron_commands.py: each one's migration report
says it would train or names the missing feature another issue brings, and two of them (one
of each) go the whole way through examples/pretrain_gpt.sh. `python tools/megatron_commands.py`
trains all of them (docs/megatron_flags.md has its table)."""

from __future__ import annotations

import os
import sys

import pytest

from engine.config.megatron.report import report
from engine.pretrain import values_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import megatron_commands  # noqa: E402

sys.path.pop(0)
FOLDERS = {"ckpt": "/ckpt", "tb": "/tb", "cache": "/cache", "prefix": "/data/stdlib_text_document"}


def test_there_are_twenty_varied_commands():
    commands = megatron_commands.COMMANDS
    assert len(commands) >= 20 and len({c.name for c in commands}) == len(commands)
    flags = {f for c in commands for f in c.flags if f.startswith("--")}
    for needed in (
        "--tensor-model-parallel-size",
        "--sequence-parallel",
        "--pipeline-model-parallel-size",
        "--num-layers-per-virtual-pipeline-stage",
        "--context-parallel-size",
        "--use-distributed-optimizer",
        "--use-megatron-fsdp",
        "--load",
        "--save",
        "--tensorboard-dir",
        "--bf16",
        "--fp16",
        "--train-samples",
    ):
        assert needed in flags, needed


@pytest.mark.parametrize("command", megatron_commands.COMMANDS, ids=lambda c: c.name)
def test_each_commands_report(command):
    lines = []
    code = report(megatron_commands._fill(command.flags, FOLDERS), values_problem, lines.append)
    if command.expect == "train":
        assert code == 0 and lines[-1] == "would train: yes", lines
    else:
        refused = [line for line in lines if ": refused: " in line]
        assert code == 2 and refused and all(command.expect in line for line in refused), lines


def test_two_commands_through_the_example_script(dataset_prefix, tokenizer_model, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for ending in (".bin", ".idx"):
        os.symlink(dataset_prefix + ending, data / f"stdlib_text_document{ending}")
    os.symlink(tokenizer_model, data / "tokenizer.model")
    chosen = [c for c in megatron_commands.COMMANDS if c.name in ("gpt3-pp2", "llama-fp8")]
    rows = megatron_commands.run(chosen, str(data), str(tmp_path / "work"), timeout=300)
    assert [r["outcome"] for r in rows] == ["trained", "trained"], rows
    assert all(r["detail"].startswith("iteration      6/6") for r in rows), rows
    assert all(r["as_expected"] for r in rows)
