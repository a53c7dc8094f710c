"""A small web crawl made on this machine, for tests and benchmarks of the web stages (no
download): real text (engine/curation/local_text.py: the standard library's docstrings, the
installed packages' descriptions) laid into HTML pages of a site template with the boilerplate
extractors are meant to remove (a cookie banner, navigation, a sidebar of links, a footer),
written as WARC files by warcio's own writer, with what a crawl also holds planted in it:
request and metadata records, images and PDFs, a page without a Content-Type, pages in
Windows-1252 and Latin-1 (declared in the HTTP header, in a <meta> tag, or not at all), one
with a UTF-8 byte-order mark, exact
copies of pages at other URLs, and pages on hosts and paths a blocklist names.

Past the texts found here (about 600), a page joins two of them. `write_sample_crawl(folder,
pages, files)` returns the manifest: for every record, its URL,
what it is (`kind`) and, for pages, the body text it was made from.
"""

from __future__ import annotations

import html
import io
import os
import random

from engine.curation.local_text import local_documents

BOILERPLATE = (
    "We use cookies to improve your experience. Accept all cookies",
    "Subscribe to our newsletter for weekly updates",
    "All rights reserved. Privacy policy | Terms of use",
)
NAVIGATION = ("Home", "World", "Business", "Technology", "Science", "Opinion", "Contact us")
SIDEBAR = (
    "Ten tips for a better morning routine",
    "The best budget laptops this year, ranked",
    "Why everyone is talking about sourdough again",
)
BLOCKED_HOST = "casino-bonus-example.com"  # listed under gambling/domains in the sample lists
BLOCKED_PATH = "news-example.org/free-prizes/winner.html"  # listed under phishing/urls


def page_html(title: str, body: str, charset: str | None = "utf-8") -> str:
    paragraphs = "\n".join(
        f"<p>{html.escape(p.strip())}</p>" for p in body.split("\n\n") if p.strip()
    )
    nav = "".join(f'<li><a href="/{n.lower()}">{n}</a></li>' for n in NAVIGATION)
    side = "".join(f'<li><a href="/story/{i}">{t}</a></li>' for i, t in enumerate(SIDEBAR))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head>'
        + (f'<meta charset="{charset}">' if charset else "")
        + f"<title>{html.escape(title)}</title></head>\n<body>\n"
        f'<div class="cookie-banner">{BOILERPLATE[0]}</div>\n'
        f"<header><nav><ul>{nav}</ul></nav></header>\n"
        f"<main><article><h1>{html.escape(title)}</h1>\n{paragraphs}\n</article></main>\n"
        f'<aside><h3>Most read</h3><ul>{side}</ul><p class="promo">{BOILERPLATE[1]}</p></aside>\n'
        f"<footer><p>&copy; 2026 Example Media. {BOILERPLATE[2]}</p></footer>\n"
        "</body></html>\n"
    )


def sample_texts(pages: int) -> list[dict]:
    """Prose and Markdown documents of at least 600 characters (pages worth keeping)."""
    texts = [d for d in local_documents(pages * 8, 600) if not d["source"].startswith("source:")]
    return texts[:pages]


def _http(status: str, content_type: str | None):
    from warcio.statusandheaders import StatusAndHeaders

    headers = [("Content-Type", content_type)] if content_type else []
    return StatusAndHeaders(status, headers, protocol="HTTP/1.1")


def write_sample_crawl(folder: str, pages: int = 60, files: int = 2, seed: int = 0) -> list[dict]:
    """WARC files crawl-NNNNN.warc.gz under `folder`; the manifest of their records."""
    from warcio.warcwriter import WARCWriter

    rng = random.Random(seed)
    texts = sample_texts(pages)
    records = []
    for i in range(pages):  # past the local texts, a page is two of them (pages differ)
        n = len(texts)
        doc = texts[i % n]
        if i >= n:
            doc = {"text": doc["text"] + "\n\n" + texts[(i // n * 7 + i) % n]["text"]}
        title = doc["text"].strip().split("\n", 1)[0][:80]
        url = f"https://site{i % 7}.example.net/articles/{i}.html"
        charset, declared = "utf-8", "header"
        if i % 10 == 3:
            charset = "windows-1252"
        elif i % 10 == 7:
            charset, declared = "latin-1", "meta"
        elif i % 20 == 9:
            charset, declared = "windows-1252", None  # left to the guess
        body = doc["text"]
        if charset != "utf-8":  # characters these charsets hold, to show they decode
            body = body + "\n\nCafé, naïve, façade: déjà vu."
        html = page_html(title, body, charset if declared else None)
        payload = html.encode(charset, errors="replace")
        if i % 100 in (15, 19):  # a UTF-8 byte-order mark (15: and no Content-Type)
            payload = b"\xef\xbb\xbf" + payload
        content_type = "text/html" + (f"; charset={charset}" if declared == "header" else "")
        if i % 10 == 5:
            content_type = None  # no type at all: recognised by its first bytes
        records.append(dict(kind="page", url=url, body=body, payload=payload, type=content_type,
                            declared=declared))  # fmt: skip
    for i in rng.sample(range(len(records)), max(1, len(records) // 10)):
        copy = dict(records[i], kind="copy", url=records[i]["url"].replace(".html", "-amp.html"))
        records.append(copy)
    blocked, body = records[1]["payload"], records[1]["body"]
    image = bytes(rng.randrange(256) for _ in range(300))
    pdf = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<<>>\nendobj\n"
    for kind, url, payload, content_type in (
        ("blocked_domain", f"https://www.{BLOCKED_HOST}/offers", blocked, "text/html"),
        ("blocked_url", f"http://{BLOCKED_PATH}", blocked, "text/html"),
        ("not_html", "https://site0.example.net/logo.png", image, "image/png"),
        ("not_html", "https://site1.example.net/report.pdf", pdf, None),  # recognised as no page
    ):
        records.append(dict(kind=kind, url=url, payload=payload, type=content_type, body=body))
    rng.shuffle(records)
    os.makedirs(folder, exist_ok=True)
    manifest = []
    for f in range(files):
        path = os.path.join(folder, f"crawl-{f:05d}.warc.gz")
        with open(path, "wb") as out:
            writer = WARCWriter(out, gzip=True)
            for record in records[f::files]:
                request = writer.create_warc_record(
                    record["url"], "request", payload=io.BytesIO(b""),
                    http_headers=_http("GET / HTTP/1.1", None),
                )  # fmt: skip
                writer.write_record(request)
                response = writer.create_warc_record(
                    record["url"], "response", payload=io.BytesIO(record["payload"]),
                    http_headers=_http("200 OK", record["type"]),
                )  # fmt: skip
                writer.write_record(response)
                described = {k: v for k, v in record.items() if k != "payload"}
                manifest.append(described | {"file": path})
    return manifest


def write_sample_blocklists(folder: str) -> str:
    """UT1-layout lists naming the planted hosts and paths (and an unrelated category)."""
    entries = {
        ("gambling", "domains"): [f"# sample list\n{BLOCKED_HOST}", "lottery-example.biz"],
        ("phishing", "urls"): [BLOCKED_PATH],
        ("adult", "domains"): ["adult-example.xxx"],
    }
    for (category, name), lines in entries.items():
        os.makedirs(os.path.join(folder, category), exist_ok=True)
        with open(os.path.join(folder, category, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    return folder


def write_sample_wet(path: str, pages: int = 10) -> list[dict]:
    """A WET file (extracted-text `conversion` records, as Common Crawl publishes beside its
    WARC files) of the sample's texts; the manifest of its records."""
    from warcio.warcwriter import WARCWriter

    manifest = []
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        for i, doc in enumerate(sample_texts(pages)):
            url = f"https://site{i % 7}.example.net/articles/{i}.html"
            payload = io.BytesIO(doc["text"].encode("utf-8"))
            record = writer.create_warc_record(
                url, "conversion", payload=payload,
                warc_content_type="text/plain",
            )  # fmt: skip
            writer.write_record(record)
            manifest.append({"url": url, "body": doc["text"]})
    return manifest
