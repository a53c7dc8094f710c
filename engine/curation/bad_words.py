"""Removing documents that contain a listed word, as C4 and datatrove's C4BadWordsFilter do:
one word list per language in the layout of the public LDNOOBW lists (a folder holding one
file per language, named by its ISO 639-1 code, one word or phrase a line).

A document's language is its `language` field (the language stage writes it, or the input
has it), else `default_language`; a language without a list is an error unless
`fail_on_missing_language` is off (then its documents are not checked). The document's
lower-cased text is searched for the list's entries (as written: an entry with a capital
letter never matches, as in C4 and datatrove), flanked by characters that are not word
characters (or the text's ends); for Japanese, Thai and Chinese, written without spaces,
anywhere. The few entries C4 allows for Japanese and Chinese are left out of every list, as
C4 and datatrove leave them out.

    bad_words:found     the text holds an entry of its language's list

`keep_fraction` keeps that share of such documents anyway (C4: none), chosen by a hash of the
text and `seed`, so the choice does not depend on workers or order.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import xxhash

from engine.errors import ConfigError, InputError

UNSPACED_LANGUAGES = ("ja", "th", "zh")
ALLOWED = {"ja": ("sm", "グロ", "女の子"), "zh": ("性",)}  # C4's allowlist


@dataclass(frozen=True)
class BadWords:
    lists: str = ""  # a folder with a word list per language (LDNOOBW's layout)
    default_language: str = "en"  # for documents without a language field
    keep_fraction: float = 0.0  # share of documents with a listed word kept anyway
    seed: int = 0
    fail_on_missing_language: bool = True  # a kept language without a list is an error

    def __post_init__(self):
        if not 0.0 <= self.keep_fraction <= 1.0:
            raise ValueError(f"keep_fraction {self.keep_fraction} is not between 0 and 1")

    def check(self, where: str) -> None:
        if not self.lists or not os.path.isdir(self.lists):
            raise ConfigError(
                f"{where}: lists {self.lists!r} is not a folder; give a folder holding one word "
                "list per language named by its code (the LDNOOBW layout: en, fr, ...)"
            )

    def check_languages(self, languages: tuple[str, ...], where: str) -> None:
        """Every language the run keeps has a list (unless fail_on_missing_language is off)."""
        missing = [x for x in languages if not os.path.isfile(os.path.join(self.lists, x))]
        if missing and self.fail_on_missing_language:
            raise ConfigError(
                f"{where}: {self.lists} has no list for {', '.join(missing)}; add the file(s) or "
                "set fail_on_missing_language: false to keep such documents unchecked"
            )


def read_word_list(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            entries = {line.strip() for line in f}
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read the word list ({err}); fix the file") from None
    for allowed in ALLOWED.values():
        entries -= set(allowed)
    entries.discard("")
    return sorted(entries)


class BadWordsMatcher:
    """`reason(text, language)` -> "bad_words:found" or None; each language's pattern is
    compiled once, when a document of it first comes."""

    def __init__(self, params: BadWords):
        self.params = params
        self.patterns: dict[str, re.Pattern | None] = {}

    def _pattern(self, language: str) -> re.Pattern | None:
        if language not in self.patterns:
            path = os.path.join(self.params.lists, language)
            if not os.path.isfile(path) and self.params.fail_on_missing_language:
                raise InputError(
                    f"{path}: no word list for a document of language {language!r} (its "
                    "`language` field); add the list or set bad_words.fail_on_missing_language: "
                    "false to keep such documents unchecked"
                )
            entries = read_word_list(path) if os.path.isfile(path) else []
            alternatives = "|".join(re.escape(w) for w in entries)
            if not entries:
                pattern = None
            elif language in UNSPACED_LANGUAGES:
                pattern = re.compile(alternatives)
            else:
                pattern = re.compile(rf"(?:\W|^)({alternatives})(?:\W|$)")
            self.patterns[language] = pattern
        return self.patterns[language]

    def reason(self, text: str, language: str | None) -> str | None:
        pattern = self._pattern(language or self.params.default_language)
        if pattern is None or pattern.search(text.lower()) is None:
            return None
        if self.params.keep_fraction > 0.0:
            draw = xxhash.xxh64_intdigest(text.encode("utf-8"), self.params.seed) / 2.0**64
            if draw < self.params.keep_fraction:
                return None
        return "bad_words:found"
