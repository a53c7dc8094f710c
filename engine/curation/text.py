"""Words, sentences and lines of a document, as the curation rules count them.

Words: runs of word characters (with inner apostrophes or hyphens, "don't", "well-known") and
runs of punctuation, each one token, as a Treebank-style tokenizer splits English; a token
made only of punctuation is a "symbol". Sentences: a line cut after `.`, `!`, `?` (or any
Unicode sentence terminal) followed by a space. Neither needs a downloaded model.
"""

from __future__ import annotations

import regex

_WORD = r"\w+(?:['’\-]\w+)*"
_WORDS = regex.compile(rf"{_WORD}|[^\w\s]+")
_CONTENT_WORDS = regex.compile(_WORD)
_SENTENCE_END = regex.compile(r"(?<=[\p{Sentence_Terminal}]['\"”’)\]]*)\s+")
_SYMBOL = regex.compile(r"^[^\w]+$")
SENTENCE_TERMINAL = regex.compile(r"[\p{Sentence_Terminal}]$")


def words(text: str) -> list[str]:
    return _WORDS.findall(text)


def content_words(text: str) -> list[str]:
    """The words of `words(text)` that are not symbols, in order."""
    return _CONTENT_WORDS.findall(text)


def is_symbol(word: str) -> bool:
    return bool(_SYMBOL.match(word))


def sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in _SENTENCE_END.split(text)) if s]


def ends_sentence(line: str) -> bool:
    """Whether the line ends with a sentence terminal (., !, ?, and their Unicode kin)."""
    return bool(SENTENCE_TERMINAL.search(line))
