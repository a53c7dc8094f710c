"""Removing pages by their URL: blocklists of domains and URLs in the layout of the public UT1
lists (one folder per category, each with a `domains` and a `urls` file, one entry a line,
`#` comments), and words in the URL counted as datatrove's URLFilter counts them.

Rules, in datatrove's order (the reason names the rule, and for a list entry its category):

    url_filter:domain:<category>     the registered domain (public suffix list) is listed
    url_filter:subdomain:<category>  the full host name is listed
    url_filter:url:<category>        the URL is listed (UT1 writes URLs without the scheme:
                                     compared without it, and as written)
    url_filter:banned_word           a banned word is one of the URL's words
    url_filter:soft_banned_words     `soft_word_threshold` soft-banned words are
    url_filter:banned_subword        a banned subword is inside the URL's letters and digits

The URL's words are its runs of ASCII letters and digits, as they are (datatrove does not
lower-case them); the word lists are lower-cased to letters and digits, as datatrove reads
them. The public suffix list is tldextract's bundled copy (nothing is downloaded).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from engine.errors import InputError

_NOT_WORD = re.compile(r"[^a-zA-Z0-9]+")


@dataclass(frozen=True)
class URLFilter:
    blocklists: tuple = ()  # UT1-layout folders
    categories: tuple = ()  # the categories used (empty: every category found)
    banned_words: str | None = None  # a file, one word a line
    soft_banned_words: str | None = None
    banned_subwords: str | None = None
    soft_word_threshold: int = 2

    def __post_init__(self):
        if self.soft_word_threshold < 1:
            raise ValueError(f"soft_word_threshold {self.soft_word_threshold}: give at least 1")
        for name in ("blocklists", "categories"):
            if not all(isinstance(v, str) and v for v in getattr(self, name)):
                raise ValueError(f"{name}: give folder names" if name == "blocklists" else
                                 f"{name}: give category names")  # fmt: skip

    @property
    def has_lists(self) -> bool:
        return bool(self.blocklists or self.banned_words or self.soft_banned_words
                    or self.banned_subwords)  # fmt: skip


def _normalise(word: str) -> str:
    return _NOT_WORD.sub("", word).lower()


def list_entries(path: str, where: str) -> list[str]:
    """The entries of a list file: its non-blank lines but `#` comments, stripped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [x.strip() for x in f if x.strip() and not x.lstrip().startswith("#")]
    except OSError as err:
        raise InputError(f"{where} {path}: cannot read it ({err.strerror}); fix the path") from None


def _without_scheme(url: str) -> str:
    rest = url.split("://", 1)[1] if "://" in url else url
    return rest.rstrip("/")


class URLRules:
    """The lists of a URLFilter, read once per shard."""

    def __init__(self, params: URLFilter):
        import tldextract

        self.params = params
        self.domains: dict[str, str] = {}
        self.urls: dict[str, str] = {}
        for folder in params.blocklists:
            self._read_blocklist(folder)
        self.banned = self._words(params.banned_words, "url_filter.banned_words")
        self.soft = self._words(params.soft_banned_words, "url_filter.soft_banned_words")
        subwords = self._words(params.banned_subwords, "url_filter.banned_subwords")
        self.subwords = re.compile("|".join(map(re.escape, sorted(subwords)))) if subwords else None
        self.extract = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

    @staticmethod
    def _words(path: str | None, where: str) -> set[str]:
        return {w for w in map(_normalise, list_entries(path, where)) if w} if path else set()

    def _read_blocklist(self, folder: str) -> None:
        where = "url_filter.blocklists"
        if not os.path.isdir(folder):
            raise InputError(f"{where} {folder}: not a folder; give UT1-layout list folders")
        found = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
        wanted = self.params.categories or found
        missing = sorted(set(wanted) - set(found))
        if missing:
            raise InputError(
                f"{where} {folder}: no category {missing[0]!r} (it has {', '.join(found)}); "
                "fix url_filter.categories"
            )
        for category in wanted:
            for name, table in (("domains", self.domains), ("urls", self.urls)):
                path = os.path.join(folder, category, name)
                if os.path.exists(path):
                    for entry in list_entries(path, where):
                        key = entry.lower() if name == "domains" else _without_scheme(entry)
                        table.setdefault(key, category)

    def reason(self, url: str) -> str | None:
        """The first rule the URL fails, or None."""
        if self.domains:
            parts = self.extract(url)
            registered = parts.top_domain_under_public_suffix
            if registered and registered.lower() in self.domains:
                return f"url_filter:domain:{self.domains[registered.lower()]}"
            if parts.fqdn and parts.fqdn.lower() in self.domains:
                return f"url_filter:subdomain:{self.domains[parts.fqdn.lower()]}"
        if self.urls:
            for key in (url, _without_scheme(url)):
                if key in self.urls:
                    return f"url_filter:url:{self.urls[key]}"
        if self.banned or self.soft:
            words = set(_NOT_WORD.split(url))
            if self.banned & words:
                return "url_filter:banned_word"
            if len(self.soft & words) >= self.params.soft_word_threshold:
                return "url_filter:soft_banned_words"
        if self.subwords is not None and self.subwords.search(_normalise(url)):
            return "url_filter:banned_subword"
        return None
