"""Documents of a WARC or WET file (Common Crawl's `.warc.gz`, `.warc.wet.gz`), read as a
stream with warcio: the HTML responses of a WARC file (the bytes decoded), the extracted-text
conversions of a WET file, each with the record's URL, date and id.

Kept: `response` records whose payload is HTML (WARC-Identified-Payload-Type, else the HTTP
Content-Type, else the bytes start as an HTML document does) and `conversion` records (WET
text). Everything else (request and metadata records, images, PDFs) is skipped and counted
by reason. The bytes are decoded with the charset the HTTP header declares, else UTF-8, else
the page's own `<meta charset>`, else charset-normalizer's guess; a page none of them decodes
is skipped and counted (`undecodable`). A file that ends inside a record or whose compression
is damaged is an InputError naming the file and the record it reached: the crawl's remaining
records cannot be found, so the run stops rather than lose them silently.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections import Counter
from collections.abc import Iterator

from engine.errors import InputError

WARC_SUFFIXES = (".warc", ".warc.gz", ".wet", ".wet.gz", ".warc.wet", ".warc.wet.gz")
HTML_TYPES = ("text/html", "application/xhtml+xml")
FIX = "re-download the file or leave it out of --input"
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.I)
_HTML_START = re.compile(
    rb"(\xef\xbb\xbf)?\s*(<!--.*?-->\s*)*<(!doctype\s+html|html|head|body)[\s>]", re.I | re.S
)
_WINDOWS_1252_LABELS = frozenset({
    "iso-8859-1", "iso8859-1", "latin1", "latin-1", "l1", "us-ascii", "ascii", "windows-1252",
    "cp1252", "x-cp1252", "iso-ir-100", "csisolatin1", "ibm819", "cp819",
})  # fmt: skip


def is_warc(path: str) -> bool:
    return path.lower().endswith(WARC_SUFFIXES)


def _mime(value: str | None) -> str | None:
    return value.split(";", 1)[0].strip().lower() if value else None


def _declared_charset(content_type: str | None) -> str | None:
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip():
            return value.strip().strip("\"'")
    return None


def _codecs(label: str | None) -> tuple[str, ...]:
    """Python's codecs for a charset label, as browsers read it (WHATWG): Latin-1 and ASCII
    labels mean Windows-1252 (its five unassigned bytes then fall back to Latin-1); UTF-8
    drops a byte-order mark."""
    if not label:
        return ()
    name = label.strip().lower()
    if name in _WINDOWS_1252_LABELS:
        return ("cp1252", "latin-1")
    if name.replace("_", "-") in ("utf-8", "utf8"):
        return ("utf-8-sig",)
    return (name,)


def decode(payload: bytes, declared: str | None) -> str | None:
    """The page's text: the declared charset, UTF-8, the page's <meta charset>, then
    charset-normalizer's guess; None when none decodes it."""
    candidates = [declared, "utf-8"]
    meta = _META_CHARSET.search(payload[:4096])
    if meta:
        candidates.append(meta.group(1).decode("ascii", "replace"))
    for label in candidates:
        for charset in _codecs(label):
            try:
                return payload.decode(charset)
            except (UnicodeDecodeError, LookupError):
                continue
    from charset_normalizer import from_bytes

    best = from_bytes(payload).best()
    return str(best) if best is not None else None


def _payload_kind(record) -> tuple[str | None, str | None]:
    """('html' | 'text' | None, the HTTP Content-Type) of a record."""
    if record.rec_type == "conversion":
        return "text", None
    if record.rec_type != "response":
        return None, None
    http = record.http_headers
    content_type = http.get_header("Content-Type") if http is not None else None
    identified = _mime(record.rec_headers.get_header("WARC-Identified-Payload-Type"))
    mime = identified or _mime(content_type)
    if mime is not None:
        return ("html" if mime in HTML_TYPES else None), content_type
    return "sniff", content_type


def read_warc(path: str, text_key: str, skipped: Counter) -> Iterator[dict]:
    """Rows {text_key: HTML or WET text, url, date, warc_record_id, warc_type} of the file,
    as it reads; `skipped` counts the records left out, by reason."""
    from warcio.archiveiterator import ArchiveIterator

    opener = gzip.open if path.lower().endswith(".gz") else open
    try:
        stream = opener(path, "rb")
    except OSError as err:
        raise InputError(f"{path}: cannot open it ({err.strerror or err}); fix --input") from None
    at = 0
    with stream:
        try:
            records = ArchiveIterator(stream, arc2warc=True)
            while True:
                record = _next_record(records, path, at)
                if record is None:
                    break
                at += 1
                _check_length(record, path, at)
                row = _row(record, text_key, skipped)
                _check_whole(record, at)
                if row is not None:
                    yield row
            _check_end(stream, records.offset)
        except (EOFError, zlib.error, OSError) as err:  # gzip.BadGzipFile is an OSError
            raise InputError(
                f"{path}: truncated or damaged after record {at} ({err}); {FIX}"
            ) from None
    if at == 0:
        raise InputError(f"{path}: holds no WARC records; {FIX}")


def _next_record(records, path: str, at: int):
    """The next record, None at the end; whatever warcio raises on a record it cannot parse
    (a missing header, a cut) is an InputError naming it: the records after it cannot be
    found."""
    try:
        return next(records)
    except StopIteration:
        return None
    except (EOFError, zlib.error, OSError):
        raise
    except Exception as err:  # warcio's ArchiveLoadFailed, or its own errors on bad headers
        raise InputError(
            f"{path}: record {at + 1} cannot be read ({type(err).__name__}: {err}); {FIX}"
        ) from None


def _check_end(stream, offset: int) -> None:
    """An EOFError when more than blank lines follow the last whole record (warcio ends
    there silently: a record cut inside its headers), or when the compressed stream ends
    early (reading to its end makes gzip check its end-of-stream marker)."""
    if offset < stream.tell():
        stream.seek(offset)
    if stream.read().strip():
        raise EOFError("the file ends inside a record")


def _check_length(record, path: str, at: int) -> None:
    """An InputError for a record without a Content-Length (its payload would run to the
    end of the file), before anything of it is read."""
    if getattr(record.raw_stream, "limit", None) is None:
        raise InputError(f"{path}: record {at} has no Content-Length; {FIX}")


def _check_whole(record, at: int) -> None:
    """Read what is left of the record; an EOFError when it ends before its Content-Length
    (warcio stops silently there)."""
    while record.raw_stream.read(1 << 16):
        pass
    if record.raw_stream.limit > 0:  # warcio's LimitReader: bytes still due
        raise EOFError(f"record {at} is {record.raw_stream.limit} bytes short")


def _row(record, text_key: str, skipped: Counter) -> dict | None:
    kind, content_type = _payload_kind(record)
    if kind is None:
        skipped["not_html" if record.rec_type == "response" else f"{record.rec_type}_record"] += 1
        return None
    payload = record.content_stream().read()
    if kind == "sniff":
        if not _HTML_START.match(payload[:1024]):
            skipped["not_html"] += 1
            return None
        kind = "html"
    text = decode(payload, _declared_charset(content_type) if kind == "html" else None)
    if text is None:
        skipped["undecodable"] += 1
        return None
    headers = record.rec_headers
    url = headers.get_header("WARC-Target-URI")
    if not url:
        skipped["no_url"] += 1
        return None
    return {
        text_key: text,
        "url": url,
        "date": headers.get_header("WARC-Date"),
        "warc_record_id": headers.get_header("WARC-Record-ID"),
        "warc_type": "html" if kind == "html" else "text",
    }
