"""Curation measured against its anchors. Prints tables and writes JSON.

1. MinHash deduplication on a corpus with planted near-duplicates (engine/curation/planted.py:
   copies of originals with words replaced, at known shingle Jaccard similarities, from just
   above each threshold to 0.3 below it): precision and recall of the documents removed, the
   recall of copies within 0.1 above the threshold, and the share removed of copies 0.1, 0.2
   and 0.3 below it, beside the probabilities the plan computes (engine/curation/lsh_plan.py).
2. The heuristic rules beside datatrove's (the library FineWeb was built with), rule set by
   rule set, on the same documents (engine/curation/local_text.py: real text found on this
   machine) and the same parameters: the share of documents both keep or both remove, each
   difference listed (a document datatrove's filter raises on is listed apart, with our
   reason, and left out of the agreement); and throughput in documents/s, ours
   (tools/curate.py's pipeline with only these rules: reading JSONL, the three steps, Parquet
   shards and the report) over
   datatrove's (its JSONL reader, the four filters, its JSONL writer), both with --workers
   processes, on the same documents cycled to --throughput-documents. Both split words and
   sentences the same way (ours): datatrove's English splitter needs NLTK's punkt data, which
   is a download.
3. The web stages (--web-pages): WARC files in, URL rules and main-text extraction beside
   datatrove's WarcReader, URLFilter and Trafilatura on the same files (agreement page by
   page, documents/s; engine/curation/web/bench_web.py), with each of our two extractors.
4. The model stages (--model-documents; engine/curation/models/bench_models.py): a quality
   classifier trained on local text and scored on held-out documents, and documents/s of the
   pipeline with the classifier, and with the perplexity stage under --perplexity-model,
   beside the pipeline with no stage, and under a KenLM model where kenlm is installed.
5. The executors (--executor-documents; engine/curation/bench_executors.py): the same run on
   the local executor, a Ray cluster and a Slurm started on this machine: wall time over local,
   and whether the files are the same; and (--memory-mb) the peak resident memory of a run
   with one worker, its input read in parts of 1,000 documents and in one part.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.curation import minhash, quality
from engine.curation.bench_executors import bench_executors, bench_memory
from engine.curation.config import CurateConfig
from engine.curation.local_text import local_documents
from engine.curation.models.bench_models import bench_models
from engine.curation.pipeline import curate
from engine.curation.planted import planted_corpus
from engine.curation.text import sentences, words
from engine.curation.web.bench_web import VARIANTS, compare_web

RULE_SETS = ("gopher_repetition", "gopher_quality", "c4", "fineweb")
BELOW = (0.1, 0.2, 0.3)  # planted copies this far below the MinHash threshold


def bench_minhash(thresholds, families: int, seed: int) -> list[dict]:
    rows = []
    for threshold in thresholds:
        near = (0.02, 0.05, 0.07, 0.1)  # copies just above the threshold, and 0.1-0.3 below
        targets = (1.0, 0.95, *(threshold + d for d in near), *(threshold - d for d in BELOW))
        corpus = planted_corpus(families, tuple(t for t in targets if t <= 1.0), seed=seed)
        config = minhash.MinHashConfig(threshold=threshold)
        start = time.perf_counter()
        first = minhash.duplicate_of(minhash.signatures(corpus.texts, config), config)
        seconds = time.perf_counter() - start
        removed = first != np.arange(len(first))
        truth = corpus.true_duplicates(threshold)
        hits = int(np.sum(removed & truth))
        copies = corpus.family != np.arange(len(first))
        close = truth & (corpus.similarity < threshold + 0.1)
        plan = config.plan()
        row = {
            "threshold": threshold,
            "bands_rows": (plan.bands, plan.rows),
            "agree": plan.agree,
            "documents": len(corpus.texts),
            "true_duplicates": int(truth.sum()),
            "removed": int(removed.sum()),
            "precision": hits / max(1, int(removed.sum())),
            "recall": hits / max(1, int(truth.sum())),
            "recall_near": float(removed[close].mean()),
            "found_at_threshold": plan.found(threshold),
            "docs_per_s": len(corpus.texts) / seconds,
        }
        for d in BELOW:  # the share removed of the copies planted d below the threshold
            planted = copies & (np.abs(corpus.similarity - (threshold - d)) < 0.03)
            row[f"removed_{d:.1f}_below"] = float(removed[planted].mean())
            row[f"found_{d:.1f}_below"] = plan.found(threshold - d)
        rows.append(row)
    return rows


def _datatrove_tokenizer():
    from datatrove.utils.word_tokenizers import WordTokenizer

    class SameSplitting(WordTokenizer):
        """Our words and sentences, for datatrove's rules (see the module docstring)."""

        def word_tokenize(self, text):
            return words(text)

        def sent_tokenize(self, text):
            return sentences(text)

        def span_tokenize(self, text):
            spans, at = [], 0
            for sentence in sentences(text):
                start = text.index(sentence, at)
                at = start + len(sentence)
                spans.append((start, at))
            return spans

    return SameSplitting("en")


def _datatrove_filters(language):
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    return {
        "gopher_repetition": GopherRepetitionFilter(language=language),
        "gopher_quality": GopherQualityFilter(language=language),
        "c4": C4QualityFilter(language=language),
        "fineweb": FineWebQualityFilter(language=language),
    }


def _ours(name: str, text: str) -> tuple[str, str | None]:
    """(the text we keep or would keep, our reason for removing it or None)."""
    rules = {
        "gopher_repetition": lambda t: (
            quality.gopher_repetition(t, quality.GopherRepetition()),
            t,
        ),
        "gopher_quality": lambda t: (quality.gopher_quality(t, quality.GopherQuality()), t),
        "c4": lambda t: quality.c4(t, quality.C4()),
        "fineweb": lambda t: (quality.fineweb(t, quality.FineWeb()), t),
    }
    reason, kept_text = rules[name](text)
    return kept_text, reason


def compare_rules(documents: list[dict]) -> dict:
    from datatrove.data import Document

    filters = _datatrove_filters(_datatrove_tokenizer())
    out = {}
    for name, theirs in filters.items():
        agree, differences, ours_removed, theirs_removed, crashes = 0, [], 0, 0, []
        for k, row in enumerate(documents):
            doc = Document(text=row["text"], id=str(k))
            try:
                result = theirs.filter(doc)
            except ArithmeticError as error:  # e.g. a ratio over zero words: no verdict
                reason = _ours(name, row["text"])[1]
                crashes.append({"document": k, "error": repr(error), "ours": reason})
                continue
            their_keep = result is True or (isinstance(result, tuple) and result[0])
            our_text, our_reason = _ours(name, row["text"])
            our_keep = our_reason is None
            same = their_keep == our_keep and (not our_keep or our_text == doc.text)
            agree += same
            ours_removed += not our_keep
            theirs_removed += not their_keep
            if not same:
                differences.append(
                    {
                        "document": k,
                        "source": row["source"],
                        "ours": our_keep,
                        "datatrove": their_keep,
                        "datatrove_reason": result[1] if isinstance(result, tuple) else None,
                    }
                )
        judged = len(documents) - len(crashes)
        out[name] = {
            "documents": len(documents),
            "agreement": agree / max(judged, 1),  # over the documents datatrove judged
            "datatrove_crashes": crashes,
            "removed_ours": ours_removed,
            "removed_datatrove": theirs_removed,
            "differences": differences,
        }
    return out


def compare_throughput(documents: list[dict], workers: int, folder: str) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    inputs = os.path.join(folder, "input")
    os.makedirs(inputs)
    for part in range(workers):
        with open(os.path.join(inputs, f"part{part}.jsonl"), "w") as f:
            for row in documents[part::workers]:
                f.write(json.dumps(row) + "\n")
    files = sorted(os.path.join(inputs, n) for n in os.listdir(inputs))
    config = CurateConfig(stages={n: c for n, c in CurateConfig().stages.items() if n in RULE_SETS})
    start = time.perf_counter()
    curate(files, os.path.join(folder, "ours"), config, workers)
    ours = time.perf_counter() - start
    pipeline = [
        JsonlReader(inputs),
        *_datatrove_filters(_datatrove_tokenizer()).values(),
        JsonlWriter(os.path.join(folder, "theirs"), compression=None),
    ]
    executor = LocalPipelineExecutor(
        pipeline,
        tasks=workers,
        workers=workers,
        logging_dir=os.path.join(folder, "logs"),
        start_method="fork",
    )
    start = time.perf_counter()
    executor.run()
    theirs = time.perf_counter() - start
    n = len(documents)
    return {
        "documents": n,
        "workers": workers,
        "ours_docs_per_s": n / ours,
        "datatrove_docs_per_s": n / theirs,
        "ratio": theirs / ours,
    }


def _table(header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).rjust(width) for cell, width in zip(row, widths, strict=False)))


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.7, 0.8, 0.9])
    parser.add_argument("--families", type=int, default=300, help="originals with planted copies")
    parser.add_argument("--documents", type=int, default=2500, help="for the rule comparison")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--throughput-documents",
        type=int,
        default=10_000,
        help="the rule comparison's documents, cycled to this many, for the throughput",
    )
    parser.add_argument("--no-datatrove", action="store_true", help="the MinHash table only")
    parser.add_argument(
        "--web-pages", type=int, default=3000, help="pages of the sample crawl (0: no web table)"
    )
    parser.add_argument(
        "--model-documents", type=int, default=3000, help="for the model stages (0: none)"
    )
    parser.add_argument("--perplexity-model", help="a tripod checkpoint or HF folder to time")
    parser.add_argument(
        "--executor-documents", type=int, default=3000, help="for the executors (0: none)"
    )
    parser.add_argument(
        "--memory-mb", type=float, nargs="*", default=[], help="input sizes for peak memory"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench_curate.json")
    args = parser.parse_args(argv)
    report = {"minhash": bench_minhash(args.thresholds, args.families, args.seed)}
    print("MinHash + LSH on planted near-duplicates (word 5-grams, 128 hash functions); "
          "removed shares measured (the plan's probability)")  # fmt: skip
    header = ["threshold", "bands x rows, agree", "docs", "true dups", "removed", "precision",
              "recall", "recall < t+0.1", "t-0.1", "t-0.2", "t-0.3"]  # fmt: skip
    rows = [
        [f"{r['threshold']:.2f}", "{} x {}, {}".format(*r["bands_rows"], r["agree"]),
         r["documents"], r["true_duplicates"], r["removed"], f"{r['precision']:.4f}",
         f"{r['recall']:.4f}", f"{r['recall_near']:.4f} ({r['found_at_threshold']:.3f})",
         *(f"{r[f'removed_{d:.1f}_below']:.3f} ({r[f'found_{d:.1f}_below']:.3f})"
           for d in BELOW)]
        for r in report["minhash"]
    ]  # fmt: skip
    _table(header, rows)
    if not args.no_datatrove:
        documents = local_documents(args.documents)
        report["rules"] = compare_rules(documents)
        print(f"\nrules beside datatrove on {len(documents)} local documents")
        header = ["rule set", "agreement", "removed (ours)", "removed (datatrove)", "differences",
                  "datatrove crashed"]  # fmt: skip
        rows = [
            [name, f"{r['agreement']:.4f}", r["removed_ours"], r["removed_datatrove"],
             len(r["differences"]), len(r["datatrove_crashes"])]
            for name, r in report["rules"].items()
        ]  # fmt: skip
        _table(header, rows)
        with tempfile.TemporaryDirectory() as folder:
            cycled = [documents[i % len(documents)] for i in range(args.throughput_documents)]
            report["throughput"] = compare_throughput(cycled, args.workers, folder)
        t = report["throughput"]
        print(f"\nthroughput, four rule sets, {t['documents']} documents, {t['workers']} workers")
        _table(
            ["ours docs/s", "datatrove docs/s", "ours / datatrove"],
            [
                [
                    f"{t['ours_docs_per_s']:.0f}",
                    f"{t['datatrove_docs_per_s']:.0f}",
                    f"{t['ratio']:.2f}",
                ]
            ],
        )
        if args.web_pages:
            with tempfile.TemporaryDirectory() as folder:
                report["web"] = compare_web(args.web_pages, args.workers, folder)
            _web_table(report["web"])
    if args.model_documents:
        with tempfile.TemporaryDirectory() as folder:
            report["models"] = bench_models(
                args.model_documents, args.workers, folder, args.perplexity_model
            )
        _models_table(report["models"])
    if args.executor_documents:
        with tempfile.TemporaryDirectory() as folder:
            report["executors"] = bench_executors(args.executor_documents, args.workers, folder)
        _executors_table(report["executors"])
    for megabytes in args.memory_mb:
        with tempfile.TemporaryDirectory() as folder:
            report.setdefault("memory", []).append(bench_memory(megabytes, folder))
        _memory_table(report["memory"][-1])
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


def _web_table(web: dict) -> None:
    differently = len(web["decoded_differently"])
    print(f"\nweb stages beside datatrove: {web['pages']} pages, {web['workers']} workers "
          f"({differently} pages decoded differently by datatrove's reader)")  # fmt: skip
    rows = [["datatrove (warcio, trafilatura)", f"{web['datatrove_docs_per_s']:.0f}", "1.00",
             "-", "-"]]  # fmt: skip
    for name, _, _ in VARIANTS:
        r = web[name]
        rows.append([f"ours ({name})", f"{r['docs_per_s']:.0f}", f"{r['speed_ratio']:.2f}",
                     f"{r['agreement']:.4f}", f"{r['agreement_decoded_alike']:.4f}"])  # fmt: skip
    _table(["pipeline", "docs/s", "speed vs datatrove", "agreement", "decoded alike"], rows)


def _models_table(models: dict) -> None:
    held, training = models["held_out"], models["training"]
    print(f"\nquality classifier trained on {training['positive']['train']} + "
          f"{training['negative']['train']} local documents in {training['seconds']:.1f} s; "
          f"held out {held['documents']}: accuracy {held['accuracy']:.4f}, AUC "
          f"{held['auc']:.4f}")  # fmt: skip
    rows = []
    for name in ("none (anchor)", "quality_classifier", "perplexity", "perplexity (KenLM)"):
        if name in models:
            r = models[name]
            rows.append([name, f"{r['docs_per_s']:.0f}", f"{r['stage_ms_per_doc']:.2f}"])
    print(f"pipeline with one model stage, {models['documents']} documents, "
          f"{models['workers']} workers")  # fmt: skip
    _table(["stage", "docs/s", "stage ms/doc (one worker)"], rows)


def _executors_table(executors: dict) -> None:
    print(f"\nexecutors: one run, {executors['documents']} documents in 4 files, 4 tasks per "
          f"corpus-wide step, {executors['workers']} CPUs")  # fmt: skip
    if "slurm_skipped" in executors:
        print(f"(no Slurm run: {executors['slurm_skipped']})")
    rows = [[name, f"{r['seconds']:.1f}", f"{r['over_local']:.2f}", str(r["same_files"])]
            for name, r in executors["runs"].items()]  # fmt: skip
    _table(["executor", "wall s", "over local", "same files as local"], rows)


def _memory_table(memory: dict) -> None:
    print(f"\npeak resident memory, one worker, {memory['input_mb']:.0f} MB of JSONL "
          f"({memory['documents']} documents)")  # fmt: skip
    rows = [[f"{per_part:,}", f"{r['peak_mb']:.0f}"] for per_part, r in memory["runs"].items()]
    _table(["documents per part", "peak MiB"], rows)


if __name__ == "__main__":
    run_main(main)
