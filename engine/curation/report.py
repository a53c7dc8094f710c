"""The report of a curation run: <output>/report.json and <output>/report.png (documents
removed per stage and rule, and the length histograms before and after)."""

from __future__ import annotations

import json
import os

import numpy as np

from engine.curation.config import STAGES, CurateConfig
from engine.curation.stats import CHAR_BINS, WORD_BINS


def _summed(parts: list[dict], when: str) -> dict:
    total = {"documents": 0, "characters": 0, "words": 0}
    chars = np.zeros(len(CHAR_BINS) - 1, int)
    words = np.zeros(len(WORD_BINS) - 1, int)
    for part in parts:
        if when in part and part[when]["documents"]:
            for key in total:
                total[key] += part[when][key]
            chars += part[when]["char_histogram"]
            words += part[when]["word_histogram"]
    return {**total, "char_histogram": chars.tolist(), "word_histogram": words.tolist()}


def _perplexity_cutoffs(work: str) -> dict:
    """The (head, middle) upper perplexities per language the perplexity stage used."""
    path = os.path.join(work, "perplexity.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_report(output: str, work: str, shards: int, config: CurateConfig) -> dict:
    parts = []
    for k in range(shards):
        for name in (os.path.join(f"shard-{k:05d}", "stats.json"), f"final-{k:05d}.json"):
            with open(os.path.join(work, name)) as f:
                parts.append(json.load(f))
    removed: dict[str, int] = {}
    for part in parts:
        for reason, count in part["removed"].items():
            removed[reason] = removed.get(reason, 0) + count
    by_stage = {name: {} for name in STAGES}
    for reason, count in sorted(removed.items()):
        by_stage.setdefault(reason.split(":")[0], {})[reason] = count
    skipped: dict[str, int] = {}
    for part in parts:
        for reason, count in part.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + count
    report = {
        "shards": shards,
        "skipped_records": dict(sorted(skipped.items())),
        "input": _summed(parts, "before"),
        "kept": _summed(parts, "after"),
        "removed": {stage: rules for stage, rules in by_stage.items() if rules},
        "removed_documents": sum(removed.values()),
        "pii_replaced": sum(p["pii_replaced"] for p in parts),
        "stages": [name for name in STAGES if config.stage(name) is not None],
        "perplexity_cutoffs": _perplexity_cutoffs(work),
        "char_bins": CHAR_BINS.tolist(),
        "word_bins": WORD_BINS.tolist(),
    }
    with open(os.path.join(output, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    _plot(report, os.path.join(output, "report.png"))
    return report


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    rules = [(r, c) for stage in report["removed"].values() for r, c in stage.items()]
    labels = ["input", *[r for r, _ in rules], "kept"]
    counts = [report["input"]["documents"], *[c for _, c in rules], report["kept"]["documents"]]
    colors = ["tab:blue", *["tab:red"] * len(rules), "tab:green"]
    axes[0].barh(range(len(labels)), counts, color=colors)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("documents")
    axes[0].set_title("documents per stage and rule")
    for ax, key, bins, unit in (
        (axes[1], "char_histogram", report["char_bins"], "characters"),
        (axes[2], "word_histogram", report["word_bins"], "words"),
    ):
        edges = np.maximum(np.asarray(bins), 1)
        for when, color in (("input", "tab:blue"), ("kept", "tab:green")):
            ax.stairs(report[when][key], edges, label=when, color=color)
        ax.set_xscale("log")
        ax.set_xlabel(f"document length ({unit})")
        ax.set_ylabel("documents")
        ax.legend()
        ax.set_title(f"{unit} per document")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
