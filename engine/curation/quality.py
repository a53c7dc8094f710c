"""Heuristic quality rules with their published thresholds: Gopher's quality and repetition
rules (Rae et al. 2021, Table A1 and section A.1.1), C4's (Raffel et al. 2020, section 2.2,
and the reference c4_utils), and FineWeb's added rules (Penedo et al. 2024).

Each rule set is a config dataclass (defaults = the published values, None turns a rule off)
and a function doc text -> (reason or None, text). Only C4's rules change a kept document's
text: they drop lines. A reason is `<rule set>:<rule>`, e.g. `gopher_quality:short_doc`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.curation.ngrams import DocumentNgrams
from engine.curation.text import content_words, ends_sentence, sentences, words

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")
BULLETS = ("•", "-")
ELLIPSES = ("...", "…")
_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")


@dataclass(frozen=True)
class GopherQuality:
    min_words: int | None = 50  # counting words that are not only punctuation
    max_words: int | None = 100_000
    min_mean_word_length: float | None = 3
    max_mean_word_length: float | None = 10
    max_symbol_word_ratio: float | None = 0.1  # "#" and ellipses, each, per word
    max_bullet_lines: float | None = 0.9
    max_ellipsis_lines: float | None = 0.3
    min_alpha_words: float | None = 0.8  # words with an alphabetic character
    min_stop_words: int | None = 2
    stop_words: tuple[str, ...] = STOP_WORDS


def gopher_quality(text: str, c: GopherQuality, tokens: list[str] | None = None) -> str | None:
    """`tokens`: words(text), when the caller has them already."""
    tokens = words(text) if tokens is None else tokens
    content = content_words(tokens)
    if c.min_words is not None and len(content) < c.min_words:
        return "gopher_quality:short_doc"
    if c.max_words is not None and len(content) > c.max_words:
        return "gopher_quality:long_doc"
    if not content:
        return "gopher_quality:no_words"
    mean = sum(len(w) for w in content) / len(content)
    if c.min_mean_word_length is not None and mean < c.min_mean_word_length:
        return "gopher_quality:short_words"
    if c.max_mean_word_length is not None and mean > c.max_mean_word_length:
        return "gopher_quality:long_words"
    if c.max_symbol_word_ratio is not None:
        if text.count("#") / len(tokens) > c.max_symbol_word_ratio:
            return "gopher_quality:hashes"
        if sum(text.count(e) for e in ELLIPSES) / len(tokens) > c.max_symbol_word_ratio:
            return "gopher_quality:ellipses"
    lines = text.splitlines() or [""]
    bullets = sum(line.lstrip().startswith(BULLETS) for line in lines)
    if c.max_bullet_lines is not None and bullets / len(lines) > c.max_bullet_lines:
        return "gopher_quality:bullet_lines"
    trailing = sum(line.rstrip().endswith(ELLIPSES) for line in lines)
    if c.max_ellipsis_lines is not None and trailing / len(lines) > c.max_ellipsis_lines:
        return "gopher_quality:ellipsis_lines"
    alpha = sum(1 for w in content if w.isalpha() or any(ch.isalpha() for ch in w))
    if c.min_alpha_words is not None and alpha / len(tokens) < c.min_alpha_words:
        return "gopher_quality:non_alpha_words"
    if c.min_stop_words is not None and len(set(c.stop_words) & set(tokens)) < c.min_stop_words:
        return "gopher_quality:few_stop_words"
    return None


@dataclass(frozen=True)
class GopherRepetition:
    max_duplicate_lines: float | None = 0.3
    max_duplicate_paragraphs: float | None = 0.3
    max_duplicate_line_chars: float | None = 0.2
    max_duplicate_paragraph_chars: float | None = 0.2
    # (n, the most frequent n-gram's characters over the document's)
    top_ngram_chars: tuple[tuple[int, float], ...] = ((2, 0.2), (3, 0.18), (4, 0.16))
    # (n, characters in n-grams seen before over the document's)
    duplicate_ngram_chars: tuple[tuple[int, float], ...] = (
        (5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)
    )  # fmt: skip


def _repeats(items: list[str]) -> tuple[int, int]:
    """(items equal to an earlier one, their characters)."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def gopher_repetition(
    text: str, c: GopherRepetition, tokens: list[str] | None = None
) -> str | None:
    """`tokens`: words(text), when the caller has them already."""
    if not text:
        return "gopher_repetition:empty"
    paragraphs = _PARAGRAPHS.split(text.strip())
    count, chars = _repeats(paragraphs)
    if (
        c.max_duplicate_paragraphs is not None
        and count / len(paragraphs) > c.max_duplicate_paragraphs
    ):
        return "gopher_repetition:duplicate_paragraphs"
    if (
        c.max_duplicate_paragraph_chars is not None
        and chars / len(text) > c.max_duplicate_paragraph_chars
    ):
        return "gopher_repetition:duplicate_paragraph_chars"
    lines = _LINES.split(text)
    count, chars = _repeats(lines)
    if c.max_duplicate_lines is not None and count / len(lines) > c.max_duplicate_lines:
        return "gopher_repetition:duplicate_lines"
    if c.max_duplicate_line_chars is not None and chars / len(text) > c.max_duplicate_line_chars:
        return "gopher_repetition:duplicate_line_chars"
    grams = DocumentNgrams(words(text) if tokens is None else tokens)
    for n, limit in c.top_ngram_chars:
        if grams.top_chars(n) / len(text) > limit:
            return f"gopher_repetition:top_{n}gram"
    for n, limit in c.duplicate_ngram_chars:
        if grams.duplicate_chars(n) / len(text) > limit:
            return f"gopher_repetition:duplicate_{n}grams"
    return None


POLICY_PHRASES = (
    "terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
    "use cookies",
)  # fmt: skip
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
C4_LINE_ENDINGS = (".", "?", "!", '"', "'")


@dataclass(frozen=True)
class C4:
    terminal_punctuation: bool = True  # keep only lines ending in . ? ! " ' (not "...")
    min_sentences: int | None = 5  # in the kept lines
    min_words_per_line: int | None = 3
    max_word_length: int | None = 1000  # a line with a longer word is dropped
    remove_citations: bool = True  # [1], [edit], [citation needed]
    lorem_ipsum: bool = True  # drops the document
    javascript: bool = True  # drops the line
    curly_bracket: bool = True  # drops the document
    policy: bool = True  # drops lines about cookies and terms of use


def c4(text: str, c: C4) -> tuple[str | None, str]:
    """(reason or None, the text of the kept lines)."""
    kept, count = [], 0
    for line in text.splitlines():
        line = line.strip()
        tokens = line.split()
        if c.max_word_length is not None and any(len(w) > c.max_word_length for w in tokens):
            continue
        if c.remove_citations:
            line = _CITATION.sub("", line)
        if c.terminal_punctuation and (not line.endswith(C4_LINE_ENDINGS) or line.endswith("...")):
            continue
        if c.min_words_per_line is not None and len(tokens) < c.min_words_per_line:
            continue
        lower = line.lower()
        if c.lorem_ipsum and "lorem ipsum" in lower:
            return "c4:lorem_ipsum", text
        if c.javascript and "javascript" in lower:
            continue
        if c.curly_bracket and "{" in line:
            return "c4:curly_bracket", text
        if c.policy and any(p in lower for p in POLICY_PHRASES):
            continue
        count += len(sentences(line))
        kept.append(line)
    if c.min_sentences is not None and count < c.min_sentences:
        return "c4:few_sentences", text
    return None, "\n".join(kept).strip()


@dataclass(frozen=True)
class FineWeb:
    min_terminal_lines: float | None = 0.12  # lines ending in a sentence terminal
    max_short_lines: float | None = 0.67
    short_line_length: int = 30  # characters
    max_duplicate_line_chars: float | None = 0.01  # over the characters outside newlines
    max_newlines_per_word: float | None = 0.3


def fineweb(text: str, c: FineWeb) -> str | None:
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return "fineweb:empty"
    terminal = sum(ends_sentence(line) for line in lines) / len(lines)
    if c.min_terminal_lines is not None and terminal < c.min_terminal_lines:
        return "fineweb:terminal_lines"
    short = sum(len(line) <= c.short_line_length for line in lines) / len(lines)
    if c.max_short_lines is not None and short > c.max_short_lines:
        return "fineweb:short_lines"
    chars = len(text.replace("\n", ""))
    if (
        c.max_duplicate_line_chars is not None
        and _repeats(lines)[1] / chars > c.max_duplicate_line_chars
    ):
        return "fineweb:duplicate_line_chars"
    tokens = words(text)
    if (
        c.max_newlines_per_word is not None
        and text.count("\n") / max(1, len(tokens)) > c.max_newlines_per_word
    ):
        return "fineweb:newlines_per_word"
    return None
