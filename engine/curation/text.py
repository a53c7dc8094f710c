"""Words, sentences and lines of a document, as the curation rules count them.

Words: runs of word characters (with inner apostrophes or hyphens, "don't", "well-known") and
runs of other non-space characters, each one token, as a Treebank-style tokenizer splits
English. A token is a "symbol", not a word, when every character of it is punctuation: ASCII
punctuation, typographic and CJK punctuation, a sentence terminal of any script, or a control
character (so "€", "©" and "•" count as words, as in datatrove). Sentences: a line cut after
a sentence terminal followed by a space. Neither needs a downloaded model.
"""

from __future__ import annotations

import string

import regex

_WORD = r"\w+(?:['’\-]\w+)*"
_WORDS = regex.compile(rf"{_WORD}|[^\w\s]+")
_SENTENCE_END = regex.compile(r"(?<=[\p{Sentence_Terminal}]['\"”’)\]]*)\s+")
_TERMINAL = regex.compile(r"[\p{Sentence_Terminal}]")
SENTENCE_TERMINAL = regex.compile(r"[\p{Sentence_Terminal}]$")
PUNCTUATION = frozenset(
    string.punctuation
    + "—–“”„‘’«»…、。，；：？！（）【】「」《》〈〉．％＄～━∶´►"
    + "".join(chr(c) for c in [*range(0, 9), 11, 12, *range(14, 32), *range(127, 160)])
)


def words(text: str) -> list[str]:
    return _WORDS.findall(text)


def is_symbol(token: str) -> bool:
    return all(ch in PUNCTUATION or _TERMINAL.match(ch) for ch in token)


def content_words(tokens: list[str]) -> list[str]:
    """The tokens that are not symbols, in order."""
    return [w for w in tokens if w[0].isalpha() or not is_symbol(w)]


def sentences(text: str) -> list[str]:
    return [s for s in (part.strip() for part in _SENTENCE_END.split(text)) if s]


def ends_sentence(line: str) -> bool:
    """Whether the line ends with a sentence terminal (., !, ?, and their Unicode kin)."""
    return bool(SENTENCE_TERMINAL.search(line))
