"""What every task of a curation run knows: the run's folder, its inputs and config, read back
from <output>/curate.json (a task on another machine needs only the folder's path), and how
many partitions the corpus-wide steps cut their work into."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.curation.config import CurateConfig, config_from_record

RECORD = "curate.json"


@dataclass(frozen=True)
class RunContext:
    output: str
    inputs: tuple[str, ...]
    config: CurateConfig
    partitions: int  # tasks of each corpus-wide step that splits by hash (--dedup-tasks)

    @property
    def work(self) -> str:
        return os.path.join(self.output, "work")

    @property
    def shards(self) -> int:
        return len(self.inputs)

    def record(self) -> dict:
        return {
            "inputs": list(self.inputs),
            "config": self.config.record(),
            "dedup_tasks": self.partitions,
            "models": model_identities(self.config),
        }

    @classmethod
    def load(cls, output: str) -> RunContext:
        with open(os.path.join(output, RECORD)) as f:
            record = json.load(f)
        config = config_from_record(record["config"], os.path.join(output, RECORD))
        return cls(output, tuple(record["inputs"]), config, record["dedup_tasks"])


def model_identities(config: CurateConfig) -> dict:
    """Each model stage's model files with their sizes and modification times: a run resumed
    with a model changed in between is refused (its documents would mix two models)."""
    out = {}
    for name in ("quality_classifier", "toxicity_classifier", "perplexity"):
        params = config.stage(name)
        if params is None:
            continue
        model = getattr(params, "kenlm", "") or params.model
        files = [model] if os.path.isfile(model) else sorted(
            os.path.join(root, n) for root, _, names in os.walk(model) for n in names
        )  # fmt: skip
        out[name] = [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files]
    return out
