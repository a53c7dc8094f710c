"""The main text of an HTML page: a maintained extractor (trafilatura, as datatrove and so
FineWeb run it, or resiliparse) drops navigation, footers, comments and other boilerplate;
then ftfy repairs what the decoding broke (mojibake, stray control characters, NFC).

trafilatura's settings are datatrove's Trafilatura extractor's (`favor_precision`,
`deduplicate`, comments left out) and so is its per-page time limit (1 s). Here the limit is
CPU time (an interval timer in the worker's main thread; where a worker runs elsewhere, no
limit), so that other processes on the machine do not decide which pages time out; it stops
Python code, not a compiled parser mid-call (that page is then judged when the call returns).
`deduplicate` drops segments seen before: each shard has its own memory of them
(`PageExtractor`), so a shard's text depends on that shard alone, as a datatrove task's on its
own. resiliparse's `extract_plain_text` runs with `main_content` and without alt texts, form
fields or comment sections. `tools/bench_curate.py --web-pages` measures both beside
datatrove's.
"""

from __future__ import annotations

import math
import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType

EXTRACTORS = ("trafilatura", "resiliparse")
FTFY_OPTIONS = MappingProxyType(
    dict(
        unescape_html=False,
        uncurl_quotes=False,
        fix_latin_ligatures=False,
        fix_character_width=False,
        normalization="NFC",
    )
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls but tab and newline, DEL
MAX_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Extraction:
    extractor: str = "trafilatura"
    favour_precision: bool = True  # trafilatura: less text, more of it right (datatrove's)
    deduplicate: bool = True  # trafilatura: segments seen before in the shard left out
    timeout: float = 1.0  # CPU seconds per page (datatrove's 1 s); 0: no limit
    fix_unicode: bool = True  # ftfy: mojibake, control characters, NFC

    def __post_init__(self):
        if self.extractor not in EXTRACTORS:
            raise ValueError(f"extractor {self.extractor!r}: use one of {', '.join(EXTRACTORS)}")
        if not (math.isfinite(self.timeout) and 0 <= self.timeout <= MAX_TIMEOUT):
            raise ValueError(f"timeout {self.timeout}: give seconds from 0 (no limit) to 3600")


class ExtractionTimeout(BaseException):
    """Past the time limit; a BaseException so that the extractor's own `except Exception`
    handlers cannot swallow it."""


@contextmanager
def _time_limit(seconds: float):
    """Raise ExtractionTimeout in this thread after `seconds` of the process's CPU time (main
    thread only; elsewhere no limit). The previous handler and timer are put back."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    state = {"done": False}

    def expire(signum, frame):
        if not state["done"]:
            raise ExtractionTimeout

    previous = signal.signal(signal.SIGPROF, expire)
    outer = signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        try:
            state["done"] = True  # a signal already on its way now does nothing
        finally:
            signal.setitimer(signal.ITIMER_PROF, *outer)
            signal.signal(signal.SIGPROF, previous if previous is not None else signal.SIG_DFL)


def fix_unicode(text: str) -> str:
    """ftfy's repairs that undo damage (mojibake, broken surrogates, control characters,
    NFC), not its restyling (curly quotes, ligatures and full-width letters stay). ASCII text
    without control characters is returned as it is: none of these repairs changes it."""
    if text.isascii() and not _CONTROL.search(text):
        return text
    import ftfy

    return ftfy.fix_text(text, **FTFY_OPTIONS)


class PageExtractor:
    """One shard's extraction: the extractor imported before any page is timed, and
    trafilatura's memory of seen segments its own."""

    def __init__(self, params: Extraction):
        self.params = params
        if params.extractor == "trafilatura":
            from trafilatura import extract
            from trafilatura.deduplication import LRU_SIZE, LRUCache

            self._trafilatura = extract
            self.seen = LRUCache(maxsize=LRU_SIZE) if params.deduplicate else False
        else:
            from resiliparse.extract.html2text import extract_plain_text
            from resiliparse.parse.html import HTMLTree

            self._resiliparse = (HTMLTree.parse, extract_plain_text)
        if params.fix_unicode:
            import ftfy  # noqa: F401 - imported outside the timed pages

    def _run(self, html: str) -> str | None:
        if self.params.extractor == "trafilatura":
            return self._trafilatura(
                html,
                favor_precision=self.params.favour_precision,
                include_comments=False,
                deduplicate=self.seen,
            )
        parse, extract_plain_text = self._resiliparse
        return extract_plain_text(parse(html), main_content=True, alt_texts=False, comments=False)

    def __call__(self, html: str) -> tuple[str | None, str | None]:
        """(reason or None, the page's main text): `extraction:empty` when nothing is left,
        `extraction:timeout` past the time limit, `extraction:error` when the extractor
        raises."""
        try:
            with _time_limit(self.params.timeout):
                text = self._run(html)
        except ExtractionTimeout:
            return "extraction:timeout", None
        except Exception:  # a page the extractor cannot parse is one removed document
            return "extraction:error", None
        if text and self.params.fix_unicode:
            text = fix_unicode(text)
        if not text or not text.strip():
            return "extraction:empty", None
        return None, text
