"""The flags a Megatron-LM training script passes, read from its text (nothing in it is run).

The script is split into words as the shell would (quotes, line continuations, comments),
then into commands. What counts: variable and array assignments (`GPT_ARGS=(...)`,
`MOE_ARGS="--num-experts 8"`: their words, split on whitespace as an unquoted `${GPT_ARGS[@]}`
is) and the words after the training entry point on the launch line (`pretrain_gpt.py`, or
this engine's `engine.pretrain`). Other commands (`mkdir`, `python tools/preprocess_data.py
...`) are skipped. `Script.entry` names the entry point, so that `pretrain_bert.py` and the
like can be told apart.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

END = "\n"  # where a flag's values end: a line's end, or shell punctuation
_PUNCTUATION = "();|&\n"
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=")
_OUR_ENTRIES = ("pretrain_gpt.py", "engine.pretrain")


@dataclass(frozen=True)
class Script:
    words: tuple[str, ...]  # the flags and values that reach the entry point, END between runs
    entry: str | None  # the entry point run (pretrain_gpt.py, pretrain_bert.py, ...)


def _without_comments(text: str) -> str:
    """The text less its comments: a `#` starting a word outside quotes, to the line's end."""
    out, quote, index = [], None, 0
    while index < len(text):
        char = text[index]
        if quote is None and char == "#" and (index == 0 or text[index - 1] in " \t\n;(|&"):
            end = text.find("\n", index)
            index = len(text) if end < 0 else end
            continue
        if char == "\\" and quote != "'" and index + 1 < len(text):
            out.append(text[index : index + 2])
            index += 2
            continue
        if char in "'\"" and quote in (None, char):
            quote = None if quote == char else char
        out.append(char)
        index += 1
    return "".join(out)


def _shell_words(text: str) -> list[str]:
    """Words and punctuation runs (a line's end is punctuation here)."""
    text = _without_comments(text.replace("\\\n", " "))
    lexer = shlex.shlex(text, posix=True, punctuation_chars=_PUNCTUATION)
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def _commands(words: list[str]) -> list[list[str]]:
    """The words split into commands at separators outside parentheses; a line's end inside
    an array becomes END."""
    commands: list[list[str]] = [[]]
    depth = 0
    for word in words:
        if not set(word) <= set(_PUNCTUATION):
            commands[-1].append(word)
            continue
        for char in word:
            if char == "(":
                depth += 1
            elif char == ")":
                depth = max(0, depth - 1)
            elif depth:
                commands[-1].append(END)
            elif commands[-1]:
                commands.append([])
    return [c for c in commands if c]


def _split(words: list[str]) -> list[str]:
    """Word splitting of an unquoted expansion: whitespace inside a word separates."""
    return [piece for word in words for piece in (word.split() if word != END else [END])]


def read_script(text: str) -> Script:
    found: list[str] = []
    entry = None
    for command in _commands(_shell_words(text)):
        first = command[0]
        assignment = _ASSIGNMENT.match(first)
        if assignment:
            value = first[assignment.end() :]
            found += _split(([value] if value else []) + command[1:]) + [END]
            continue
        for index, word in enumerate(command):
            name = os.path.basename(word)
            if name in _OUR_ENTRIES or re.fullmatch(r"pretrain_\w+\.py", name):
                entry = entry or name
                found += _split(command[index + 1 :]) + [END]
                break
    return Script(tuple(found), entry)


def read_script_file(path: str) -> Script:
    with open(path, encoding="utf-8") as f:
        return read_script(f.read())
