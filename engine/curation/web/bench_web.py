"""tools/bench_curate.py --web-pages: the web stages beside datatrove's on the same WARC files
(engine/curation/web/sample_crawl.py). Ours: tools/curate.py's pipeline with only the URL
rules and the extraction (reading the WARC files, both stages, the Parquet shards and the
report), once per extractor. datatrove's: its WarcReader, URLFilter (given the same lists,
its bundled ones off) and Trafilatura extractor (FineWeb's), then its JSONL writer. Both with
the same worker processes, one task per WARC file.

Agreement, page by page: both remove it, or both keep it with the same text. Pages whose
HTML the two readers decoded differently (datatrove's reader ignores the declared charset and
guesses; it tells a page without a Content-Type by libmagic, ours by its first bytes) are
counted apart, and the agreement is also given on the pages decoded alike (the
extractors' own agreement); ours runs with and without its Unicode repair (ftfy), which
datatrove does not do.
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections import Counter

from engine.curation.config import CurateConfig
from engine.curation.pipeline import curate
from engine.curation.web.extract import Extraction
from engine.curation.web.sample_crawl import write_sample_blocklists, write_sample_crawl
from engine.curation.web.urls import URLFilter, list_entries
from engine.curation.web.warc import read_warc

# (row name, extractor, Unicode repair): trafilatura without the repair is datatrove's stage
VARIANTS = (
    ("trafilatura", "trafilatura", True),
    ("trafilatura, no repair", "trafilatura", False),
    ("resiliparse", "resiliparse", True),
)


def _lines(path: str) -> list[str]:
    return list_entries(path, "blocklist") if os.path.exists(path) else []


def _ours(files, lists, workers, folder, extractor, repair) -> tuple[float, dict]:
    stages = {
        "url_filter": URLFilter(blocklists=(lists,)),
        "extraction": Extraction(extractor=extractor, fix_unicode=repair),
    }
    out = os.path.join(folder, f"ours-{extractor}-{repair}")
    start = time.perf_counter()
    curate(files, out, CurateConfig(stages=stages), workers)
    seconds = time.perf_counter() - start
    import pyarrow.parquet as pq

    kept = {}
    for path in sorted(glob.glob(os.path.join(out, "kept", "*.parquet"))):
        kept.update({r["url"]: r["text"] for r in pq.read_table(path).to_pylist()})
    return seconds, kept


def _datatrove(crawl, lists, workers, folder) -> tuple[float, dict]:
    import tldextract
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.filters import URLFilter as DatatroveURLFilter
    from datatrove.pipeline.readers import WarcReader
    from datatrove.pipeline.writers import JsonlWriter

    categories = sorted(os.listdir(lists))
    domains = [d for c in categories for d in _lines(os.path.join(lists, c, "domains"))]
    urls = [f"{s}://{u}" for c in categories for u in _lines(os.path.join(lists, c, "urls"))
            for s in ("http", "https")]  # fmt: skip

    class OfflineURLFilter(DatatroveURLFilter):  # the bundled public suffix list, as ours
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tldextractor = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)
            self.banned_subwords_automaton.make_automaton()

    out = os.path.join(folder, "datatrove")
    pipeline = [
        WarcReader(crawl, glob_pattern="*.warc.gz"),
        OfflineURLFilter(extra_domains=domains, extra_urls=urls, use_integrated_lists=False),
        Trafilatura(),
        JsonlWriter(out, compression=None),
    ]
    tasks = len(glob.glob(os.path.join(crawl, "*.warc.gz")))
    executor = LocalPipelineExecutor(
        pipeline, tasks=tasks, workers=workers, logging_dir=os.path.join(folder, "logs"),
        start_method="fork",
    )  # fmt: skip
    start = time.perf_counter()
    executor.run()
    seconds = time.perf_counter() - start
    kept = {}
    for path in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                kept[row["metadata"]["url"]] = row["text"]
    return seconds, kept


def _decoded_alike(files) -> dict[str, bool]:
    """Per page URL either reader gives: whether datatrove's reader gives it with the HTML
    decoded as ours (False too where one reader leaves the page out)."""
    from datatrove.pipeline.readers.warc import process_record
    from warcio.archiveiterator import ArchiveIterator

    ours = {r["url"]: r["text"] for f in files for r in read_warc(f, "text", Counter())}
    alike = dict.fromkeys(ours, False)
    for path in files:
        with open(path, "rb") as stream:
            for record in ArchiveIterator(stream):
                theirs = process_record(record)
                if theirs:
                    alike[theirs["url"]] = theirs["text"] == ours.get(theirs["url"])
    return alike


def compare_web(pages: int, workers: int, folder: str) -> dict:
    crawl = os.path.join(folder, "crawl")
    write_sample_crawl(crawl, pages=pages, files=max(2, workers))
    lists = write_sample_blocklists(os.path.join(folder, "lists"))
    files = sorted(glob.glob(os.path.join(crawl, "*.warc.gz")))
    alike = _decoded_alike(files)
    theirs_s, theirs = _datatrove(crawl, lists, workers, folder)
    out = {"pages": len(alike), "workers": workers, "datatrove_docs_per_s": len(alike) / theirs_s}
    out["decoded_differently"] = sorted(u for u, same in alike.items() if not same)
    for name, extractor, repair in VARIANTS:
        seconds, ours = _ours(files, lists, workers, folder, extractor, repair)
        agree = {u: ours.get(u) == theirs.get(u) for u in alike}
        same = [u for u in alike if alike[u]]
        out[name] = {
            "docs_per_s": len(alike) / seconds,
            "speed_ratio": theirs_s / seconds,
            "kept_ours": len(ours),
            "kept_datatrove": len(theirs),
            "agreement": sum(agree.values()) / len(agree),
            "agreement_decoded_alike": sum(agree[u] for u in same) / max(1, len(same)),
            "differences": sorted(u for u, a in agree.items() if not a),
        }
    return out
