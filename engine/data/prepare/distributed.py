"""tools/preprocess_data.py on several machines (--executor ray|slurm, engine/execution/): a task
per input file tokenizes it into a dataset of its own under <output-prefix>.parts/, then one
task merges them, in input order, into <output-prefix>_<key>_document.bin/.idx: the files one
process writes from the same inputs (tested byte for byte). A run killed anywhere is resumed
by the same command (finished tasks are kept); the parts are removed once the merge is in
place. Every machine must see the inputs and the output folder at the same paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from engine.config.tokenizer import TokenizerConfig, config_from_record, tokenizer_record
from engine.data.indexed.dataset import IndexedDataset, IndexedDatasetBuilder
from engine.data.prepare.preprocess import (
    PreprocessStats,
    no_documents_message,
    output_prefix_for,
    preprocess,
)
from engine.errors import InputError
from engine.execution.job import Stage, TaskJob, fault_in_task, keep_record

RECORD = "preprocess.json"


@dataclasses.dataclass(frozen=True)
class PreprocessRun:
    output_prefix: str
    files: tuple[str, ...]
    tokenizer: TokenizerConfig
    keys: tuple[str, ...]
    append_eod: bool
    skip_bad_records: bool
    tokenize_with: str

    @property
    def folder(self) -> str:
        return os.path.abspath(self.output_prefix) + ".parts"

    def record(self) -> dict:
        return {
            "output_prefix": os.path.abspath(self.output_prefix),
            "files": [os.path.abspath(f) for f in self.files],
            "tokenizer": tokenizer_record(self.tokenizer),
            "keys": list(self.keys),
            "append_eod": self.append_eod,
            "skip_bad_records": self.skip_bad_records,
            "tokenize_with": self.tokenize_with,
        }

    @classmethod
    def load(cls, folder: str) -> PreprocessRun:
        with open(os.path.join(folder, RECORD)) as f:
            r = json.load(f)
        tokenizer = config_from_record({"tokenizer": r["tokenizer"]})
        return cls(r["output_prefix"], tuple(r["files"]), tokenizer, tuple(r["keys"]),
                   r["append_eod"], r["skip_bad_records"], r["tokenize_with"])  # fmt: skip


def part_prefix(folder: str, k: int) -> str:
    return os.path.join(folder, f"part-{k:05d}")


def stages(run: PreprocessRun) -> list[Stage]:
    return [Stage("tokenize", len(run.files)), Stage("merge", 1)]


def preprocess_job(run: PreprocessRun) -> TaskJob:
    folder = run.folder
    return TaskJob("preprocess", folder, os.path.join(folder, "done"),
                   os.path.join(folder, "logs"), run_task,
                   "engine.data.prepare.task_main")  # fmt: skip


def start(run: PreprocessRun) -> None:
    """The parts folder with the run's record; a folder of another run is refused."""
    os.makedirs(run.folder, exist_ok=True)
    refusal = (
        f"--output-prefix {run.output_prefix}: {run.folder} holds a run of other inputs or "
        "settings; delete it to start afresh"
    )
    keep_record(os.path.join(run.folder, RECORD), run.record(), refusal)


def run_task(folder: str, stage: str, index: int) -> None:
    run = PreprocessRun.load(folder)
    done = preprocess_job(run).marker(stage, index)
    if os.path.exists(done):
        return
    if stage == "tokenize":
        stats = preprocess(
            [run.files[index]], part_prefix(folder, index), run.tokenizer, list(run.keys),
            run.append_eod, workers=1, skip_bad_records=run.skip_bad_records, progress=False,
            tokenize_with=run.tokenize_with, allow_empty=True, in_process=True,
        )  # fmt: skip
        _save_stats(part_prefix(folder, index) + ".json", stats)
    elif stage == "merge":
        _merge(run)
    else:
        raise ValueError(f"no preprocessing stage {stage!r}")
    fault_in_task(stage, index)
    os.makedirs(os.path.dirname(done), exist_ok=True)
    open(done, "w").close()


def _save_stats(path: str, stats: PreprocessStats) -> None:
    fields = ("documents", "tokens", "skipped", "empty", "input_bytes", "skip_messages")
    with open(path + ".tmp", "w") as f:
        json.dump({k: getattr(stats, k) for k in fields}, f)
    os.replace(path + ".tmp", path)


def summed_stats(run: PreprocessRun) -> PreprocessStats:
    total = PreprocessStats()
    for k in range(len(run.files)):
        with open(part_prefix(run.folder, k) + ".json") as f:
            part = json.load(f)
        for name in ("documents", "tokens", "skipped", "empty", "input_bytes"):
            setattr(total, name, getattr(total, name) + part[name])
        total.skip_messages.extend(part["skip_messages"][: 5 - len(total.skip_messages)])
    total.outputs = [output_prefix_for(run.output_prefix, key) for key in run.keys]
    return total


def _merge(run: PreprocessRun) -> None:
    """Every part with documents, in input order, into the output datasets (each written
    whole, then renamed into place, as one process writes them)."""
    stats = summed_stats(run)
    if stats.documents == 0:
        raise InputError(no_documents_message(list(run.files), stats))
    kept = [k for k in range(len(run.files)) if _documents(run, k)]
    builders = []
    try:
        for key in run.keys:
            parts = [output_prefix_for(part_prefix(run.folder, k), key) for k in kept]
            first = IndexedDataset(parts[0])
            dtype = first.dtype
            first.close()
            builder = IndexedDatasetBuilder(output_prefix_for(run.output_prefix, key), dtype)
            builders.append(builder)
            for prefix in parts:
                builder.add_index(prefix)
        for builder in builders:
            builder.prepare()
        for builder in builders:
            builder.commit()
    except BaseException:
        for builder in builders:
            builder.abort()
        raise


def _documents(run: PreprocessRun, k: int) -> int:
    with open(part_prefix(run.folder, k) + ".json") as f:
        return json.load(f)["documents"]


def finish(run: PreprocessRun) -> PreprocessStats:
    """The summed counts; the parts folder removed (the outputs are in place)."""
    stats = summed_stats(run)
    shutil.rmtree(run.folder, ignore_errors=True)
    return stats
