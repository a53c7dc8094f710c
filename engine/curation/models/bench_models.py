"""tools/bench_curate.py --model-documents: the model stages' cost. A quality classifier is
trained (tools/train_quality_classifier.py's code) on real text found here
(engine/curation/local_text.py: standard-library docstrings as the positives, its sources as
the negatives, a tenth of each held out at random), then tools/curate.py's pipeline runs on the
same documents with no stage (the anchor: reading JSONL, the three steps, the Parquet
shards), with the quality classifier alone, and with the perplexity stage alone when a
reference model is given (--perplexity-model), and under a KenLM bigram model made from the
same prose (engine/curation/models/arpa.py, where kenlm is installed): documents/s of each and
the stage's own share of the time."""

from __future__ import annotations

import importlib.util
import json
import os
import time

from engine.curation.config import STAGES, CurateConfig
from engine.curation.local_text import local_documents
from engine.curation.models.arpa import write_ccnet_models
from engine.curation.models.classifier import QualityClassifier
from engine.curation.models.perplexity import Perplexity
from engine.curation.models.train_classifier import TrainingSettings, train_classifier
from engine.curation.pipeline import curate


def _timed_run(documents: list[dict], stages: dict, workers: int, folder: str) -> float:
    """Documents/s of the pipeline with only `stages`."""
    inputs = []
    per_file = -(-len(documents) // (2 * workers))  # two files per worker
    for k in range(0, len(documents), per_file):
        path = os.path.join(folder, f"in-{k:06d}.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in documents[k : k + per_file])
        inputs.append(path)
    config = CurateConfig(stages={n: p for n, p in stages.items() if n in STAGES})
    start = time.perf_counter()
    curate(inputs, os.path.join(folder, "out"), config, workers)
    return len(documents) / (time.perf_counter() - start)


def bench_models(count: int, workers: int, folder: str, perplexity_model: str | None) -> dict:
    documents = local_documents(count)
    prose = [d["text"] for d in documents if d["source"].startswith("docstring:")]
    code = [d["text"] for d in documents if d["source"].startswith("source:")]
    model = os.path.join(folder, "quality.bin")
    start = time.perf_counter()
    counts, evaluation = train_classifier(prose, code, model, TrainingSettings(epoch=10))
    report = {
        "documents": len(documents),
        "workers": workers,
        "training": {"seconds": time.perf_counter() - start, **counts},
        "held_out": evaluation.__dict__ if evaluation else None,
    }
    runs = {
        "none (anchor)": {},
        "quality_classifier": {"quality_classifier": QualityClassifier(model)},
    }
    if perplexity_model:
        runs["perplexity"] = {"perplexity": Perplexity(model=perplexity_model)}
    if importlib.util.find_spec("kenlm") is not None:  # a bigram model over 600 pieces
        kenlm_folder = os.path.join(folder, "kenlm")
        os.makedirs(kenlm_folder)
        write_ccnet_models(prose, kenlm_folder)
        runs["perplexity (KenLM)"] = {"perplexity": Perplexity(kenlm=kenlm_folder)}
    for name, stages in runs.items():
        sub = os.path.join(folder, "run-" + name.split()[0] + str(len(name)))
        os.makedirs(sub)
        report[name] = {"docs_per_s": _timed_run(documents, stages, workers, sub)}
    anchor = report["none (anchor)"]["docs_per_s"]
    for name in runs:
        rate = report[name]["docs_per_s"]
        # seconds per document the stage adds, over the anchor's
        report[name]["stage_ms_per_doc"] = 1000 * workers * (1 / rate - 1 / anchor)
    return report
