"""Megatron-LM's training flags, as its releases define them: the lists in this folder
(`core_v0.16.1.tsv`, `core_v0.19.0.tsv`), written by tools/megatron_flag_list.py from a
Megatron-LM checkout (flag, parser group, default, action and type; one line per option string).

`megatron_flags()` reads them into one `MegatronFlag` per option string (the newest release's
definition where both have the flag), which is what this engine needs to parse a flag it does
not implement: whether it takes values, how many, which, and Megatron-LM's default.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass, replace

FOLDER = os.path.dirname(os.path.abspath(__file__))
RELEASES = ("core_v0.16.1", "core_v0.19.0")  # oldest first

_SWITCH_ACTIONS = {
    "store_true": True,
    "store_false": False,
    "BooleanOptionalAction": True,
    "BooleanOptionalAction(negative": False,
}


@dataclass(frozen=True)
class MegatronFlag:
    flag: str
    dest: str
    group: str  # Megatron-LM's parser function / argument group
    default: str  # as Megatron-LM's source writes it (a literal or an expression)
    switch_value: bool | None  # the value a switch sets; None: the flag takes values
    nargs: str | None  # argparse's nargs for a flag taking values (None: one value)
    value_type: str  # int, float, str or an enum's name
    choices: tuple[str, ...] | None
    releases: tuple[str, ...]
    defaults: tuple[str, ...] = ()  # every release's default (they may differ)

    def default_value(self, text: str | None = None):
        """Megatron-LM's default (the newest release's, or `text`) as a Python value: a
        literal, arithmetic on numbers, an enum member's name (signal.SIGTERM -> SIGTERM, as
        given on a command line), else the source text (an environment lookup)."""
        text = self.default if text is None else text
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            pass
        number = _arithmetic(text)  # such as 2 ** 32 or 1024 * 1024
        if number is not None:
            return number
        member = re.fullmatch(r"[A-Za-z_][\w.]*\.([A-Za-z_]\w*)", text)
        return member.group(1) if member else text  # an enum's member by the name one gives

    def parsed(self, given):
        """A value as given on a command line (a string or a list of strings) as a number
        where it reads as one (Megatron-LM's custom types included), else the string."""
        if isinstance(given, list):
            return [self.parsed(item) for item in given]
        if not isinstance(given, str) or self.value_type == "str":
            return given
        for kind in (int, float):
            try:
                return kind(given)
            except ValueError:
                pass
        return given

    def at_default(self, given) -> bool:
        """Whether `given` (a parsed command-line value) is Megatron-LM's default, in any
        release that has the flag (or the value it stands for when not given)."""
        value = given if self.switch_value is not None else self.parsed(given)
        texts = (*self.defaults, self.default, *EFFECTIVE_DEFAULTS.get(self.flag, ()))
        for default in (self.default_value(text) for text in texts):
            if isinstance(value, list) and not isinstance(default, list):
                if len(value) == 1 and value[0] == default:
                    return True
            elif value == default:
                return True
        return False


# Defaults Megatron-LM's parser leaves unset and its argument checks then fill in.
EFFECTIVE_DEFAULTS = {"--dataloader-type": ("'single'",)}


def _arithmetic(text: str) -> int | float | None:
    """The value of a default written as arithmetic on numbers (2 ** 32, 1024 * 1024)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Pow | ast.Add):
            left, right = value(node.left), value(node.right)
            if left is None or right is None:
                return None
            if isinstance(node.op, ast.Mult):
                return left * right
            return left**right if isinstance(node.op, ast.Pow) else left + right
        return None

    return value(tree)


def _field(kind: str, name: str) -> str | None:
    match = re.search(rf"(?:^| ){name}=(\{{[^}}]*\}}|\S+)", kind)
    return match.group(1) if match else None


def _choices(text: str | None) -> tuple[str, ...] | None:
    """The plain choices of a flag (None where the list reads as an expression, such as a
    list-valued enum's)."""
    if not text:
        return None
    choices = tuple(text.strip("{}").split(","))
    return choices if all(re.fullmatch(r"[\w.\-]+", c) for c in choices) else None


def _parse_row(line: str, release: str) -> MegatronFlag:
    flag, group, default, kind = line.rstrip("\n").split("\t")[:4]
    action = kind.split(" ", 1)[0]
    switch = _SWITCH_ACTIONS.get(action)
    if action == "store_const":
        switch = True
    choices = _field(kind, "choices")
    nargs = _field(kind, "nargs")
    value_type = _field(kind, "type") or "str"
    return MegatronFlag(
        flag=flag,
        dest=_field(kind, "dest") or flag.lstrip("-").replace("-", "_"),
        group=group,
        default=default,
        switch_value=switch,
        nargs=nargs.strip("'\"") if nargs else None,
        value_type=value_type.split("[", 1)[0],
        choices=_choices(choices),
        releases=(release,),
    )


def read_release(release: str) -> dict[str, MegatronFlag]:
    """{flag: its definition} of one release's list."""
    with open(os.path.join(FOLDER, release + ".tsv"), encoding="utf-8") as f:
        rows = [_parse_row(line, release) for line in f if line.strip() and line[0] != "#"]
    return {row.flag: row for row in rows}


@functools.cache
def megatron_flags() -> dict[str, MegatronFlag]:
    """Every flag of every release in RELEASES, the newest definition of each, with the
    releases that have it."""
    merged: dict[str, MegatronFlag] = {}
    for release in RELEASES:
        for flag, row in read_release(release).items():
            earlier = merged.get(flag)
            releases = (earlier.releases if earlier else ()) + (release,)
            defaults = (earlier.defaults if earlier else ()) + (row.default,)
            merged[flag] = replace(row, releases=releases, defaults=defaults)
    return merged
