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
from dataclasses import dataclass

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

    def default_value(self):
        """Megatron-LM's default as a Python value, or the source text where it is an
        expression (an environment lookup, an enum member)."""
        try:
            return ast.literal_eval(self.default)
        except (ValueError, SyntaxError):
            pass
        power = re.fullmatch(r"(\d+) \*\* (\d+)", self.default)  # such as 2 ** 32
        return int(power.group(1)) ** int(power.group(2)) if power else self.default

    def parsed(self, given):
        """A value as given on a command line (a string or a list of strings), converted to
        the flag's type where it has a plain one (strings that do not convert stay strings)."""
        if isinstance(given, list):
            return [self.parsed(item) for item in given]
        if not isinstance(given, str) or self.value_type not in ("int", "float"):
            return given
        try:
            return int(given) if self.value_type == "int" else float(given)
        except ValueError:
            return given

    def at_default(self, given) -> bool:
        """Whether `given` (a parsed command-line value) is Megatron-LM's default."""
        default = self.default_value()
        value = given if self.switch_value is not None else self.parsed(given)
        if isinstance(value, list) and not isinstance(default, list):
            return len(value) == 1 and value[0] == default
        return value == default


def _field(kind: str, name: str) -> str | None:
    match = re.search(rf"(?:^| ){name}=(\{{[^}}]*\}}|\S+)", kind)
    return match.group(1) if match else None


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
        choices=tuple(choices.strip("{}").split(",")) if choices else None,
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
            earlier = merged[flag].releases if flag in merged else ()
            merged[flag] = MegatronFlag(**{**row.__dict__, "releases": earlier + (release,)})
    return merged
