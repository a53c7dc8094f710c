"""What this engine does with a Megatron-LM command line, flag by flag.

    python -m engine.pretrain --check-megatron-args --num-layers 32 ... --fp8-format hybrid
    python -m engine.pretrain --check-megatron-args examples/pretrain_gpt.sh

Given flags, or a shell script (its `--flags` are read from the text, torchrun's own are
skipped), each flag is answered: implemented (same meaning), accepted without effect (and why),
refused (the missing feature, or what the flag is for when it is not pretraining), or unknown
to Megatron-LM's training parser. Exit code 0 if the command would train, 2 if not. A command
line without shell variables is also parsed as the training entry point parses it, so a value
this engine refuses is reported too.
"""

from __future__ import annotations

import dataclasses
import os
import shlex

from engine.config.megatron.compat import (
    MISSING_KIND,
    NO_EFFECT_KIND,
    SAME,
    Answer,
    refusal,
    table_answers,
)
from engine.config.megatron.releases import megatron_flags


def implemented_flags() -> set[str]:
    """The flags of this engine's own configs."""
    from engine.config.arguments import flags_of
    from engine.config.configs import SECTIONS

    return {
        flag
        for _, cls, _ in SECTIONS
        if dataclasses.is_dataclass(cls) and not hasattr(cls, "add_arguments")
        for field in dataclasses.fields(cls)
        if "help" in field.metadata
        for flag in flags_of(field)
    }


def answer_of(flag: str, implemented: set[str]) -> Answer | None:
    """The answer to one flag (None: neither Megatron-LM's nor this engine's)."""
    if flag in implemented:
        return Answer(SAME, "")
    return table_answers().get(flag)


def launcher_flags() -> set[str]:
    """torchrun's own flags (a script's launcher line), from torch's parser."""
    from torch.distributed.run import get_args_parser

    return {s for action in get_args_parser()._actions for s in action.option_strings}


END = "\n"  # a script's end of line: the values of a flag end there


def flags_of(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """(flag, the values after it) for each `--flag` among the tokens; a value list ends at
    the next flag, a line's end or shell punctuation."""
    found: list[tuple[str, list[str]]] = []
    taking = False
    for token in tokens:
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            found.append((flag, [value] if eq else []))
            taking = True
        elif token == END or set(token) <= set("();|&"):
            taking = False
        elif taking:
            found[-1][1].append(token)
    return found


def script_tokens(path: str) -> list[str]:
    """A shell script's words, line by line (END between lines), comments and line
    continuations removed (variables stay as written)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    tokens = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars="();|&")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens += [*lexer, END]
    return tokens


def line_for(flag: str, values: list[str], answer: Answer | None) -> tuple[str, bool]:
    """(the report's line for a flag, whether it stops the run)."""
    if answer is None:
        return f"{flag}: unknown: not a flag of Megatron-LM's training parser or this engine", True
    if answer.kind == SAME and flag not in megatron_flags():
        return f"{flag}: this engine's own flag (Megatron-LM has none of this name)", False
    if answer.kind == SAME:
        return f"{flag}: implemented (Megatron-LM's meaning)", False
    if answer.kind == NO_EFFECT_KIND:
        return f"{flag}: accepted without effect: {answer.why}", False
    definition = megatron_flags()[flag]
    if definition.switch_value is None and values:
        value = values[0] if definition.nargs is None else values
        if definition.at_default(value):
            return f"{flag}: accepted without effect: at Megatron-LM's default", False
    kind = "refused" if answer.kind == MISSING_KIND else "refused (not pretraining)"
    line = f"{flag}: {kind}: {refusal(flag, answer).split(': ', 1)[1]}"
    if any("$" in v for v in values):
        line += f" (unless its value is Megatron-LM's default, {definition.default})"
    return line, True


def report(argv: list[str], values_problem, out=print) -> int:
    """Print the report of a command line or script; 0 if it would train, else 2.
    `values_problem(argv)`: the training entry point's own parse and checks of a command line
    (None, or the one line saying what is wrong)."""
    script = len(argv) == 1 and os.path.isfile(argv[0])
    tokens = script_tokens(argv[0]) if script else argv
    skip = launcher_flags() if script else set()
    implemented = implemented_flags()
    stops = 0
    for flag, values in flags_of(tokens):
        if flag in skip:
            continue
        line, stop = line_for(flag, values, answer_of(flag, implemented))
        stops += stop
        out(line)
    if not stops and not script and not any("$" in t for t in tokens):
        problem = values_problem(tokens)
        if problem:
            out(f"values: {problem}")
            stops += 1
    out(f"would train: {'no' if stops else 'yes'}")
    return 2 if stops else 0
