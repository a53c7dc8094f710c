"""The main text of an HTML page: a maintained extractor (trafilatura, as datatrove and so
FineWeb run it, or resiliparse) drops navigation, footers, comments and other boilerplate;
then ftfy repairs what the decoding broke (mojibake, stray control characters, NFC).

trafilatura's settings are datatrove's Trafilatura extractor's (`favor_precision`,
`deduplicate`, comments left out) and so is its per-document time limit (1 s), here by
an interval timer in the worker's main thread (where a worker runs elsewhere, no limit).
resiliparse's `extract_plain_text` runs with `main_content` and without alt texts, form fields
or comment sections. `tools/bench_curate.py --web` measures both beside datatrove's.
"""

from __future__ import annotations

import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass

EXTRACTORS = ("trafilatura", "resiliparse")
FTFY_OPTIONS = dict(
    unescape_html=False,
    uncurl_quotes=False,
    fix_latin_ligatures=False,
    fix_character_width=False,
    normalization="NFC",
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls but tab and newline, DEL


@dataclass(frozen=True)
class Extraction:
    extractor: str = "trafilatura"
    favour_precision: bool = True  # trafilatura: less text, more of it right (datatrove's)
    deduplicate: bool = True  # trafilatura: repeated segments of the page once
    timeout: float = 1.0  # seconds per page (datatrove's); 0: no limit
    fix_unicode: bool = True  # ftfy: mojibake, control characters, NFC

    def __post_init__(self):
        if self.extractor not in EXTRACTORS:
            raise ValueError(f"extractor {self.extractor!r}: use one of {', '.join(EXTRACTORS)}")
        if not self.timeout >= 0:
            raise ValueError(f"timeout {self.timeout}: give seconds >= 0 (0: no limit)")


class ExtractionTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float):
    """Raise ExtractionTimeout in this thread after `seconds` (main thread only; else none)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise ExtractionTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def start_shard(params: Extraction) -> None:
    """Forget the segments trafilatura's `deduplicate` has seen (a cache of the process): a
    shard's text then depends on that shard alone, as a datatrove task's does on its own, and
    not on which shards a worker process happened to extract before (nor on a resume)."""
    if params.extractor == "trafilatura" and params.deduplicate:
        from trafilatura.deduplication import LRU_TEST

        LRU_TEST.clear()


def _trafilatura(html: str, params: Extraction) -> str | None:
    from trafilatura import extract

    return extract(
        html,
        favor_precision=params.favour_precision,
        include_comments=False,
        deduplicate=params.deduplicate,
    )


def _resiliparse(html: str, params: Extraction) -> str | None:
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    tree = HTMLTree.parse(html)
    return extract_plain_text(tree, main_content=True, alt_texts=False, comments=False)


def fix_unicode(text: str) -> str:
    """ftfy's repairs that undo damage (mojibake, broken surrogates, control characters,
    NFC), not its restyling (curly quotes, ligatures and full-width letters stay). ASCII text
    without control characters is returned as it is: none of these repairs changes it."""
    if text.isascii() and not _CONTROL.search(text):
        return text
    import ftfy

    return ftfy.fix_text(text, **FTFY_OPTIONS)


def extract_text(html: str, params: Extraction) -> tuple[str | None, str | None]:
    """(reason or None, the page's main text): `extraction:empty` when nothing is left,
    `extraction:timeout` past the time limit, `extraction:error` when the extractor raises."""
    run = _trafilatura if params.extractor == "trafilatura" else _resiliparse
    try:
        with _time_limit(params.timeout):
            text = run(html, params)
    except ExtractionTimeout:
        return "extraction:timeout", None
    except Exception:  # a page the extractor cannot parse is one removed document
        return "extraction:error", None
    if text and params.fix_unicode:
        text = fix_unicode(text)
    if not text or not text.strip():
        return "extraction:empty", None
    return None, text
