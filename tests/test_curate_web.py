"""Curation from a web crawl: WARC files read as a stream (HTML responses only, charsets,
URL/date/id kept, other records skipped and counted), main-text extraction against datatrove's
own extractor, URL rules against datatrove's URLFilter, and the whole run from WARC files
(engine/curation/web/sample_crawl.py: real local text in pages with planted boilerplate,
copies, blocked hosts and paths, images, PDFs and requests)."""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections import Counter

import pyarrow.parquet as pq
import pytest

from engine.curation.web.extract import (
    FTFY_OPTIONS,
    Extraction,
    PageExtractor,
    fix_unicode,
)
from engine.curation.web.sample_crawl import (
    BOILERPLATE,
    NAVIGATION,
    SIDEBAR,
    sample_texts,
    write_sample_blocklists,
    write_sample_crawl,
    write_sample_wet,
)
from engine.curation.web.urls import URLFilter, URLRules
from engine.curation.web.warc import read_warc
from tests.cli import one_line_error, run_tool
from tests.requirements import require

PAGES = 40
# the share of a page's paragraphs each extractor keeps whole (measured on the sample crawl)
BODY_KEPT = {"trafilatura": 0.97, "resiliparse": 0.97}  # 771 and 774 of 776


@pytest.fixture(scope="module")
def crawl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crawl")
    manifest = write_sample_crawl(str(folder / "warc"), pages=PAGES, files=2)
    lists = write_sample_blocklists(str(folder / "lists"))
    return {"folder": str(folder / "warc"), "manifest": manifest, "lists": lists}


def _read_all(folder: str) -> tuple[list[dict], Counter]:
    skipped = Counter()
    rows = [
        r for f in sorted(glob.glob(f"{folder}/*.warc.gz")) for r in read_warc(f, "text", skipped)
    ]
    return rows, skipped


def _parquet_rows(folder) -> list[dict]:
    files = sorted(glob.glob(f"{folder}/*.parquet"))
    return [row for path in files for row in pq.read_table(path).to_pylist()]


def test_warc_pages_with_their_url_date_and_charset(crawl):
    rows, skipped = _read_all(crawl["folder"])
    pages = [r for r in crawl["manifest"] if r["kind"] != "not_html"]
    assert sorted(r["url"] for r in rows) == sorted(r["url"] for r in pages)
    # every response has its request record; the image and the PDF (no type) are no pages
    assert skipped == Counter(request_record=len(crawl["manifest"]), not_html=2)
    by_url = {r["url"]: r for r in rows}
    for record in pages:
        row = by_url[record["url"]]
        assert row["warc_type"] == "html" and row["date"] and row["warc_record_id"]
        assert not row["text"].startswith("\ufeff")  # a byte-order mark dropped
        # declared in the HTTP header or a <meta> tag: decoded right (undeclared: a guess)
        if "Café" in record["body"] and record.get("declared"):
            assert "Café, naïve, façade: déjà vu." in row["text"], record["url"]
    assert any(r.get("declared") is None for r in pages)  # the guess is exercised


def test_wet_files_give_their_text_as_it_is(tmp_path):
    """Common Crawl's WET files: extracted text, no HTML to extract; curated from it."""
    path = str(tmp_path / "sample.warc.wet.gz")
    manifest = write_sample_wet(path, pages=6)
    skipped = Counter()
    rows = list(read_warc(path, "text", skipped))
    assert [(r["url"], r["text"], r["warc_type"]) for r in rows] == [
        (m["url"], m["body"], "text") for m in manifest
    ]
    assert not skipped
    out = tmp_path / "out"
    config = tmp_path / "c.json"
    rules = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb")
    config.write_text(json.dumps(dict.fromkeys(rules, False)))
    result = run_tool("curate.py", "--input", path, "--output", str(out), "--config", str(config))
    assert result.returncode == 0, result.stderr
    kept = _parquet_rows(out / "kept")
    assert sorted(r["url"] for r in kept) == sorted(m["url"] for m in manifest)


def test_damaged_warc_files_are_one_line_and_a_fixed_file_resumes(crawl, tmp_path):
    """A truncated .warc.gz, a cut .warc, a record warcio cannot parse, an empty file: one
    line naming the file; the shard finished before the damaged one is kept, and the same
    command run again once the file is whole finishes the run."""
    source = sorted(glob.glob(f"{crawl['folder']}/*.warc.gz"))[0]
    with open(source, "rb") as f:
        data = f.read()
    damaged = tmp_path / "b.warc.gz"
    damaged.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    command = ("curate.py", "--input", source, str(damaged), "--output", str(out))
    line = one_line_error(run_tool(*command))
    assert f"{damaged}: truncated or damaged after record" in line
    assert "re-download the file or leave it out of --input" in line
    finished = out / "work" / "shard-00000" / "stats.json"
    stamp = os.path.getmtime(finished)
    damaged.write_bytes(data)  # downloaded again
    assert run_tool(*command).returncode == 0
    assert os.path.getmtime(finished) == stamp  # the first shard was not redone
    plain = gzip.decompress(data)
    cases = {
        "cut.warc": (plain[:4000], "truncated or damaged after record"),
        "header.warc.gz": (data[:10], "truncated or damaged after record 0"),
        "empty.warc": (b"", "holds no WARC records"),
        "nouri.warc": (plain.replace(b"WARC-Target-URI:", b"X-Target-URI:", 1), "cannot be read"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        result = run_tool("curate.py", "--input", str(path), "--output", str(tmp_path / name[:-5]))
        assert f"{path}: " in one_line_error(result) and message in result.stderr, name


@pytest.mark.parametrize("extractor", ["trafilatura", "resiliparse"])
def test_extraction_keeps_the_body_and_drops_the_boilerplate(crawl, extractor):
    rows, _ = _read_all(crawl["folder"])
    bodies = {r["url"]: r["body"] for r in crawl["manifest"] if r["kind"] == "page"}
    extract = PageExtractor(Extraction(extractor=extractor, timeout=0))  # one shard's
    found = total = 0
    for row in rows:
        if row["url"] not in bodies:
            continue
        reason, text = extract(row["text"])
        assert reason is None, (row["url"], reason)
        for phrase in (*BOILERPLATE, *SIDEBAR, " | ".join(NAVIGATION[:3])):
            assert phrase not in text, (extractor, row["url"], phrase)
        paragraphs = [" ".join(p.split()) for p in bodies[row["url"]].split("\n\n") if p.strip()]
        flat = " ".join(text.split())
        found += sum(p in flat for p in paragraphs)
        total += len(paragraphs)
    assert found / total >= BODY_KEPT[extractor], (extractor, found, total)


def test_trafilatura_extraction_equals_datatrove_extractor(crawl):
    """datatrove's Trafilatura step (FineWeb's extractor, its settings) on the same pages gives
    the same text as ours with the Unicode repair off, page for page (time limits off on both
    sides: which pages reach one depends on the machine)."""
    require("datatrove")
    from datatrove.data import Document
    from datatrove.pipeline.extractors import Trafilatura

    rows, _ = _read_all(crawl["folder"])
    documents = [Document(text=r["text"], id=r["url"]) for r in rows]
    from trafilatura.deduplication import LRU_TEST

    LRU_TEST.clear()  # datatrove's extraction process forks from this one: its cache empty
    theirs = {d.id: d.text for d in Trafilatura(timeout=600).run(iter(documents))}
    extract = PageExtractor(Extraction(fix_unicode=False, timeout=0))
    ours = {r["url"]: extract(r["text"])[1] for r in rows}
    assert ours == theirs


def test_unicode_repair_fixes_mojibake_and_leaves_style_alone():
    html = "<html><body><article><p>{}</p></article></body></html>"
    text = "The caf\u00c3\u00a9 \u201cquoted\u201d \ufb01ne text, " * 20  # UTF-8 read as Latin-1
    reason, out = PageExtractor(Extraction(extractor="resiliparse"))(html.format(text))
    assert reason is None
    assert "café" in out and "\u00c3" not in out
    assert "\u201cquoted\u201d" in out and "\ufb01ne" in out  # curly quotes, ligature kept


def test_the_ascii_shortcut_of_the_repair_is_what_ftfy_does():
    """ASCII text without control characters skips ftfy: ftfy with the same options leaves
    every such text of the sample as it is; a control character still goes through it."""
    import ftfy

    texts = [d["text"] for d in sample_texts(80)] + ["a\ttab\nand <b>&amp;</b> x", "\n"]
    ascii_texts = [t for t in texts if t.isascii()]
    assert len(ascii_texts) > 20
    for text in ascii_texts:
        assert ftfy.fix_text(text, **FTFY_OPTIONS) == text == fix_unicode(text)
    assert fix_unicode("bell\x07 and\r\nbreak") == "bell and\nbreak"


def test_the_time_limit_removes_a_slow_page_and_puts_the_handler_back():
    import signal

    before = signal.getsignal(signal.SIGPROF)
    page = "<html><body>" + "<div><p>A sentence of the page that goes on.</p></div>" * 20_000
    extract = PageExtractor(Extraction(timeout=0.05))
    assert extract(page + "</body></html>")[0] == "extraction:timeout"
    assert signal.getsignal(signal.SIGPROF) is before
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)


def test_empty_pages_are_removed_with_their_reason():
    for extractor in ("trafilatura", "resiliparse"):
        page = "<html><head><script>var a = 1;</script></head><body><div> </div></body></html>"
        reason, _ = PageExtractor(Extraction(extractor=extractor))(page)
        assert reason == "extraction:empty", extractor


URLS = [
    "https://www.casino-bonus-example.com/offers",
    "https://casino-bonus-example.com/",
    "https://shop.lottery-example.biz/a",
    "https://lottery-example.biz.evil.net/",
    "http://news-example.org/free-prizes/winner.html",
    "http://news-example.org/free-prizes/other.html",
    "https://blog.example.com/my-poker-night",
    "https://blog.example.com/Poker-night",
    "https://example.com/hot-girls-dating",
    "https://example.com/hot-weather",
    "https://example.com/xxxvideos",
    "https://example.com/a/b?c=d",
    "https://adult-example.xxx/x",
]


def _word_lists(folder):
    files = {"banned": "poker\n# a comment\n", "soft": "hot\ngirls\ndating\n", "sub": "xxxvid\n"}
    for name, text in files.items():
        (folder / f"{name}.txt").write_text(text)
    return {name: str(folder / f"{name}.txt") for name in files}


def test_url_rules_match_datatrove_url_filter(crawl, tmp_path):
    """Decision and rule for every URL equal datatrove's URLFilter given the same lists (its
    own bundled lists off), on hosts, subdomains, paths, banned, soft-banned and subwords."""
    require("datatrove")
    import tldextract
    from datatrove.data import Document
    from datatrove.pipeline.filters import URLFilter as DatatroveURLFilter

    words = _word_lists(tmp_path)
    ours = URLRules(
        URLFilter(blocklists=(crawl["lists"],), banned_words=words["banned"],
                  soft_banned_words=words["soft"], banned_subwords=words["sub"])
    )  # fmt: skip

    def read(path):
        with open(path) as f:
            return f.read().splitlines()

    lists = crawl["lists"]
    theirs = DatatroveURLFilter(
        extra_domains=[*read(f"{lists}/gambling/domains"), *read(f"{lists}/adult/domains")],
        extra_urls=["http://" + u for u in read(f"{lists}/phishing/urls")],
        banned_words=read(words["banned"]), soft_banned_words=read(words["soft"]),
        banned_subwords=read(words["sub"]), use_integrated_lists=False,
    )  # fmt: skip
    theirs.tldextractor = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)
    theirs.banned_subwords_automaton.make_automaton()
    datatrove_rule = {
        "domain": "domain", "subdomain": "subdomain", "url": "url",
        "hard_blacklisted": "banned_word", "soft_blacklisted": "soft_banned_words",
        "blacklisted_subword": "banned_subword",
    }  # fmt: skip
    for url in URLS:
        verdict = theirs.filter(Document(text="", id=url, metadata={"url": url}))
        expected = None if verdict is True else datatrove_rule[verdict[1]]
        got = ours.reason(url)
        assert (got.split(":")[1] if got else None) == expected, url
    assert ours.reason(URLS[0]) == "url_filter:domain:gambling"
    assert ours.reason(URLS[4]) == "url_filter:url:phishing"
    assert ours.reason(URLS[11]) is None


def test_curating_a_crawl_end_to_end(crawl, tmp_path):
    """WARC files in, kept pages out with their URL and date: boilerplate gone, the blocked
    host and path removed with their rule, exact copies removed, records skipped counted."""
    config = tmp_path / "web.yaml"
    config.write_text(json.dumps({"url_filter": {"blocklists": [crawl["lists"]]}}))
    out = tmp_path / "out"
    result = run_tool("curate.py", "--input", crawl["folder"], "--output", str(out),
                      "--config", str(config), "--workers", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "records skipped: not_html 2, request_record" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["skipped_records"] == {"not_html": 2, "request_record": len(crawl["manifest"])}
    assert report["removed"]["url_filter"] == {
        "url_filter:domain:gambling": 1, "url_filter:url:phishing": 1
    }  # fmt: skip
    kept = [
        r for f in sorted(glob.glob(f"{out}/kept/*.parquet")) for r in pq.read_table(f).to_pylist()
    ]
    removed = [
        r
        for f in sorted(glob.glob(f"{out}/removed/*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert kept and all(r["url"] and r["date"] and r["warc_record_id"] for r in kept)
    for row in kept:
        assert not any(phrase in row["text"] for phrase in BOILERPLATE), row["url"]
    copies = {r["url"] for r in crawl["manifest"] if r["kind"] == "copy"}
    reasons = {r["url"]: r["curate_reason"] for r in removed}
    # a copy is removed as such unless a rule removed it (or its original) first
    assert any(reasons.get(url) == "exact_dedup:document" for url in copies)
    kept_urls = {r["url"] for r in kept}
    assert not any(u in kept_urls and u.replace("-amp", "") in kept_urls for u in copies)
    # the same output with one worker
    one = tmp_path / "one"
    result = run_tool("curate.py", "--input", crawl["folder"], "--output", str(one),
                      "--config", str(config), "--workers", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _parquet_rows(one / "kept") == kept
    _check_inspection(out, kept, removed, tmp_path)


def _check_inspection(out, kept, removed, tmp_path):
    """tools/inspect_curation.py: per rule the documents of smallest hash of (seed, text),
    their text escaped, the same page for the same seed, another sample for another."""
    import html

    import xxhash

    def page(seed, name):
        path = tmp_path / name
        result = run_tool("inspect_curation.py", "--run", str(out), "--per-rule", "2",
                          "--seed", str(seed), "--output", str(path))  # fmt: skip
        assert result.returncode == 0, result.stderr
        return path.read_text()

    first = page(0, "a.html")
    body = first.split("<section", 1)[1]  # after the header, which names the seed
    assert page(0, "b.html") == first and page(1, "c.html").split("<section", 1)[1] != body
    groups = {"kept": [r["text"] for r in kept]}
    for row in removed:
        groups.setdefault(row["curate_reason"], []).append(row["text"])
    sections = first.split('<section class="')[1:]
    assert len(sections) == len(groups)
    for rule, texts in groups.items():
        section = next(x for x in sections if f'id="{rule}"' in x)
        assert f"({min(2, len(texts))} of {len(texts):,})" in section
        chosen = sorted(texts, key=lambda t: xxhash.xxh64_intdigest(t.encode(), 0))[:2]
        for text in chosen:
            assert html.escape(text[:3000]) in section, rule
        assert "<html" not in section.lower()  # a removed page's HTML is shown as text


def test_web_config_errors_are_one_line(crawl, tmp_path):
    cases = [
        ({"url_filter": {"blocklists": [str(tmp_path / "nowhere")]}}, "not a folder"),
        ({"url_filter": {"blocklists": [crawl["lists"]], "categories": ["sports"]}},
         "no category 'sports' (it has adult, gambling, phishing); fix url_filter.categories"),
        ({"url_filter": {"banned_words": str(tmp_path / "none.txt")}}, "cannot read it"),
        ({"extraction": {"extractor": "readability"}}, "use one of trafilatura, resiliparse"),
        ({"extraction": {"timeout": 5000}}, "give seconds from 0 (no limit) to 3600"),
        ({"url_filter": {"blocklists": [None]}}, "blocklists: give folder names"),
        ({"url_filter": True}, "give blocklists or word lists"),
        ({"url_filter": {"soft_word_threshold": 0}}, "give at least 1"),
    ]  # fmt: skip
    source = sorted(glob.glob(f"{crawl['folder']}/*.warc.gz"))[0]
    for i, (config, message) in enumerate(cases):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(json.dumps(config))
        result = run_tool("curate.py", "--input", source, "--output", str(tmp_path / f"o{i}"),
                          "--config", str(path))  # fmt: skip
        assert message in one_line_error(result), config
