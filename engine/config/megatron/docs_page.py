"""docs/megatron_flags.md, written from the table (engine/config/megatron/answers.py):

    python -m engine.config.megatron.docs_page > docs/megatron_flags.md

tests/test_megatron_table.py checks the page is the table's.
"""

from __future__ import annotations

from engine.config.megatron.answers import (
    DIFFERENT_DEFAULTS,
    MISSING,
    NO_EFFECT,
    NOT_APPLICABLE,
)
from engine.config.megatron.releases import RELEASES, megatron_flags
from engine.config.megatron.report import implemented_flags


def _release_note(flag: str, definitions) -> str:
    releases = definitions[flag].releases
    return "" if len(releases) == len(RELEASES) else f" ({releases[0]} only)"


def _groups(title: str, intro: str, table: dict[str, tuple[str, ...]], definitions) -> list[str]:
    lines = ["", f"## {title}", "", intro, ""]
    for why in sorted(table):
        flags = ", ".join(f"`{f}`{_release_note(f, definitions)}" for f in table[why])
        lines.append(f"- **{why}** ({len(table[why])}): {flags}")
    return lines


def page() -> str:
    definitions = megatron_flags()
    implemented = sorted(implemented_flags() & set(definitions))
    counts = [len(implemented)] + [
        sum(len(flags) for flags in table.values())
        for table in (NO_EFFECT, MISSING, NOT_APPLICABLE)
    ]
    lines = [
        "# Megatron-LM's flags",
        "",
        "<!-- written by `python -m engine.config.megatron.docs_page`; do not edit -->",
        "",
        f"Every flag of Megatron-LM's training parser in {' and '.join(RELEASES)} "
        f"({len(definitions)} option strings: those `megatron/training/arguments.py` writes "
        "out and those it generates from its config dataclasses, listed in "
        "`engine/config/megatron/*.tsv` by `tools/megatron_flag_list.py`) has one answer here, "
        "from one table (`engine/config/megatron/answers.py`). "
        "`python -m engine.pretrain --check-megatron-args <flags or script>` prints the answer "
        "to each flag of a command and whether it would train.",
        "",
        "| answer | flags |",
        "| --- | --- |",
        f"| implemented, Megatron-LM's meaning and default | {counts[0]} |",
        f"| accepted without effect (named in one line at start) | {counts[1]} |",
        f"| refused: a feature this engine lacks | {counts[2]} |",
        f"| refused: not pretraining GPT-style models | {counts[3]} |",
        "",
        "A refused flag given at Megatron-LM's default value asks for nothing and is accepted "
        "without effect (such as `--expert-model-parallel-size 1`).",
        "",
        "## Implemented",
        "",
        ", ".join(f"`{f}`" for f in implemented),
        "",
        "Defaults that differ from Megatron-LM's literal default:",
        "",
    ]
    lines += [f"- `{flag}`: {why}" for flag, why in sorted(DIFFERENT_DEFAULTS.items())]
    lines += _groups(
        "Accepted without effect",
        "Each only picks something that cannot change results here; grouped by why.",
        NO_EFFECT,
        definitions,
    )
    lines += _groups(
        "Refused: missing here",
        "Refused in one line naming the feature (`<flag>: <feature>: not available in this "
        "engine; drop <flag>`).",
        MISSING,
        definitions,
    )
    lines += _groups(
        "Refused: not pretraining",
        "Refused in one line saying what the flag is for.",
        NOT_APPLICABLE,
        definitions,
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(page(), end="")
