"""A seeded sample of a curation run's documents, per removal rule and of the kept ones, as one
HTML page a person reads in a browser to check what each rule removes (tools/inspect_curation.py).

The sample of a rule is the `per_rule` documents with the smallest hash of (seed, text): the
same for the same run and seed, whatever the order of the files or the number of workers
that wrote them, and read as a stream (memory holds the sample, not the run).
"""

from __future__ import annotations

import heapq
import html
import json
import os
from dataclasses import dataclass, field

import xxhash

from engine.curation.config import STAGES
from engine.errors import InputError

KEPT = "kept"
SHOWN_FIELDS = ("url", "date", "language", "language_score", "quality_score", "toxicity_score",
                "perplexity", "perplexity_bucket", "source", "id")  # fmt: skip


@dataclass
class Sample:
    per_rule: int
    seed: int
    heaps: dict = field(default_factory=dict)  # rule -> [(-hash, order, row)], the smallest
    counts: dict = field(default_factory=dict)

    def offer(self, rule: str, row: dict, text_key: str) -> None:
        self.counts[rule] = self.counts.get(rule, 0) + 1
        key = xxhash.xxh64_intdigest(str(row.get(text_key, "")).encode("utf-8"), self.seed)
        heap = self.heaps.setdefault(rule, [])
        entry = (-key, self.counts[rule], row)  # the count breaks ties between equal texts
        if len(heap) < self.per_rule:
            heapq.heappush(heap, entry)
        elif -heap[0][0] > key:
            heapq.heapreplace(heap, entry)

    def documents(self, rule: str) -> list[dict]:
        """The sample of `rule`, smallest hash first."""
        return [row for _, _, row in sorted(self.heaps.get(rule, []), key=lambda e: -e[0])]


def _parquet_files(folder: str) -> list[str]:
    return sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(folder)
        for name in names
        if name.endswith(".parquet")
    )


def sample_run(output: str, per_rule: int, seed: int) -> tuple[Sample, dict, str]:
    """(the sample, the run's report, its text field) of the curation run in `output`."""
    import pyarrow.parquet as pq

    paths = {name: os.path.join(output, name) for name in ("curate.json", "report.json")}
    for path in paths.values():
        if not os.path.isfile(path):
            raise InputError(
                f"{path}: missing; give --run the --output of a finished tools/curate.py run"
            )
    with open(paths["curate.json"]) as f:
        text_key = json.load(f)["config"]["text_key"]
    with open(paths["report.json"]) as f:
        report = json.load(f)
    sample = Sample(per_rule, seed)
    for kind in (KEPT, "removed"):
        for path in _parquet_files(os.path.join(output, kind)):
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1000):
                for row in batch.to_pylist():
                    rule = row.pop("curate_reason", None) if kind == "removed" else KEPT
                    sample.offer(rule, row, text_key)
    return sample, report, text_key


def _rules_in_order(sample: Sample) -> list[str]:
    """Removal rules in the order their stages run, then the kept documents."""
    order = {name: i for i, name in enumerate(STAGES)}
    rules = [r for r in sample.counts if r != KEPT]
    rules.sort(key=lambda r: (order.get(r.split(":")[0], len(order)), r))
    return [*rules, KEPT] if KEPT in sample.counts else rules


def _document(row: dict, text_key: str, max_chars: int) -> str:
    text = str(row.get(text_key, ""))
    shown = text[:max_chars]
    cut = f" … ({len(text) - max_chars:,} more characters)" if len(text) > max_chars else ""
    fields = [(k, row[k]) for k in SHOWN_FIELDS if row.get(k) is not None]
    meta = " · ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {html.escape(str(v))}" for k, v in fields
    )
    return (
        f'<div class="doc"><div class="meta">{meta or "&nbsp;"} · {len(text):,} characters</div>'
        f"<pre>{html.escape(shown)}{html.escape(cut)}</pre></div>"
    )


STYLE = """body{font-family:sans-serif;margin:2em;max-width:70em;color:#222}
h2{border-bottom:1px solid #ccc;margin-top:1.6em}.kept h2{color:#1a7f37}.removed h2{color:#b42318}
.doc{border:1px solid #ddd;border-radius:4px;margin:.6em 0;padding:.4em .8em;background:#fafafa}
.meta{font-size:.8em;color:#555}pre{white-space:pre-wrap;font-size:.85em;max-height:22em;
overflow:auto;margin:.3em 0}table{border-collapse:collapse}td{padding:.1em .8em}"""


def render(sample: Sample, report: dict, text_key: str, max_chars: int, source: str) -> str:
    rules = _rules_in_order(sample)
    total = report["input"]["documents"]
    rows = "".join(
        f'<tr><td><a href="#{html.escape(r)}">{html.escape(r)}</a></td>'
        f"<td align=right>{sample.counts[r]:,}</td>"
        f"<td align=right>{100 * sample.counts[r] / max(total, 1):.1f}%</td></tr>"
        for r in rules
    )
    sections = []
    for rule in rules:
        documents = sample.documents(rule)
        kind = "kept" if rule == KEPT else "removed"
        title = "kept" if rule == KEPT else f"removed: {rule}"
        body = "".join(_document(row, text_key, max_chars) for row in documents)
        sections.append(
            f'<section class="{kind}" id="{html.escape(rule)}"><h2>{html.escape(title)} '
            f"({len(documents)} of {sample.counts[rule]:,})</h2>{body}</section>"
        )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>curation sample: "
        f"{html.escape(source)}</title><style>{STYLE}</style></head><body>"
        f"<h1>Curation sample: {html.escape(source)}</h1>"
        f"<p>{total:,} documents in, {report['kept']['documents']:,} kept; up to "
        f"{sample.per_rule} documents per rule, drawn with seed {sample.seed}.</p>"
        f"<table><tr><th>rule</th><th>documents</th><th>of input</th></tr>{rows}</table>"
        f"{''.join(sections)}</body></html>"
    )
