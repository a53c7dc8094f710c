"""--wandb-project/--wandb-exp-name as Megatron-LM logs to Weights & Biases: a real offline
wandb run (WANDB_MODE=offline, no network) whose history, read back from the run file wandb
wrote (its record log, parsed with wandb's own protobuf classes), holds the same numbers as
the JSONL under Megatron-LM's tag names; without wandb the flag is one line. wandb 0.31 has no
Python reader of its record log (the datastore moved into the Go wandb-core, `wandb sync` has no
view, an offline run writes no summary file), so the log's block framing is read here."""

from __future__ import annotations

import glob
import json
import os

import pytest

from engine.errors import ConfigError
from engine.pretrain import parse
from engine.train.preflight import prepare
from tests.requirements import require
from tests.test_training import base_args, pretrain, records

BLOCK = 32768  # the record log's block size (LevelDB's log format, as wandb writes it)


def wandb_records(path: str) -> list:
    """The protobuf Records of a .wandb run file."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, pending, found = 7, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        kind = data[pos + 6] if left >= 7 else 0
        if kind == 0:  # padding to the end of the block
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
            pending = b""
    return found


def test_an_offline_wandb_run_logs_megatron_tags(dataset_prefix, tokenizer_model, tmp_path):
    require("wandb")
    log, save = str(tmp_path / "m.jsonl"), str(tmp_path / "ckpt")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\ndef main(\n")
    flags = {
        "--eval-prompts": str(prompts),
        "--eval-max-new-tokens": "4",
        "--train-iters": "6",
        "--log-interval": "2",
        "--eval-interval": "3",
        "--log-jsonl": log,
        "--save": save,
        "--wandb-project": "tripod-test",
        "--wandb-exp-name": "offline-run",
    }
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    assert pretrain(2, base_args(dataset_prefix, tokenizer_model, **flags), env) == [0, 0]
    [run_file] = glob.glob(os.path.join(save, "wandb", "wandb", "offline-run-*", "run-*.wandb"))
    history, runs = {}, []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append((record.run.project, record.run.display_name))
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            step = history.setdefault(record.history.step.num, {})
            step.update({key: json.loads(value) for key, value in items.items()})
    assert runs[0] == ("tripod-test", "offline-run")
    jsonl = records(log)
    for r in (r for r in jsonl if "split" not in r and "samples" not in r):
        logged = history[r["iteration"]]
        assert logged["lm loss"] == pytest.approx(r["lm_loss"], rel=1e-6)
        assert logged["learning-rate"] == r["lr"]
        assert logged["grad-norm"] == pytest.approx(r["grad_norm"], rel=1e-6)
        assert logged["samples vs steps"] == r["consumed_samples"]
    for r in (r for r in jsonl if r.get("split") == "valid"):
        assert history[r["iteration"]]["lm loss validation"] == pytest.approx(r["lm_loss"])
    assert sorted(k for k in history if "lm loss" in history[k]) == [2, 4, 6]
    # generation samples (--eval-prompts) as a table at each valid evaluation
    sampled = [r for r in jsonl if "samples" in r]
    assert [r["iteration"] for r in sampled] == [3, 6]
    for r in sampled:
        logged = history[r["iteration"]]
        table = {k.removeprefix("samples/"): v for k, v in logged.items() if "samples/" in k}
        assert table["_type"] == "table-file" and table["nrows"] == 2
        [path] = glob.glob(os.path.join(os.path.dirname(run_file), "files", table["path"]))
        with open(path) as f:
            rows = json.load(f)["data"]
        assert rows == [[s["prompt"], s["greedy"], s["sampled"]] for s in r["samples"]]


def test_wandb_flags_are_checked_in_one_line(monkeypatch, tmp_path):
    import engine.monitor.wandb

    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "64", "--wandb-project", "p",
    ]  # fmt: skip
    if engine.monitor.wandb.wandb_importable():
        with pytest.raises(ConfigError, match="give --wandb-save-dir DIR or --save DIR"):
            prepare(parse(argv), 1)
        prepare(parse(argv + ["--wandb-save-dir", str(tmp_path)]), 1)
    # as on a machine without wandb
    monkeypatch.setattr(engine.monitor.wandb, "wandb_importable", lambda: False)
    with pytest.raises(ConfigError, match="--wandb-project: wandb is not importable"):
        prepare(parse(argv + ["--save", str(tmp_path)]), 1)
