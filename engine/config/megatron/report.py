"""What this engine does with a Megatron-LM command line, flag by flag.

    python -m engine.pretrain --check-megatron-args --num-layers 32 ... --fp8-format hybrid
    python -m engine.pretrain --check-megatron-args examples/pretrain_gpt.sh

Given flags, or a shell script (its flags read from the text by engine/config/megatron/
script.py; torchrun's own skipped), each flag is answered: implemented (same meaning),
accepted without effect (and why), refused (the missing feature, or what the flag is for when
it is not pretraining), or unknown to Megatron-LM's training parser; a script whose entry
point is not pretrain_gpt.py is refused. Exit code 0 if the command would train, 2 if not. A
command line without shell variables is also checked as the training entry point checks its
configuration (not its files or devices, which may be elsewhere), so a value this engine
refuses is reported too.
"""

from __future__ import annotations

import dataclasses
import os

from engine.config.megatron.compat import (
    MISSING_KIND,
    NO_EFFECT_KIND,
    SAME,
    Answer,
    asks_for_something,
    refusal,
    table_answers,
    value_problem,
)
from engine.config.megatron.releases import megatron_flags
from engine.config.megatron.script import END, read_script_file


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


def flags_with_values(words) -> list[tuple[str, list[str]]]:
    """(flag, the values after it) for each `--flag` among the words; a value list ends at
    the next flag or at END."""
    found: list[tuple[str, list[str]]] = []
    taking = False
    for word in words:
        if word.startswith("--"):
            flag, eq, value = word.partition("=")
            found.append((flag, [value] if eq else []))
            taking = True
        elif word == END:
            taking = False
        elif taking:
            found[-1][1].append(word)
    return found


def line_for(flag: str, values: list[str], answer: Answer | None) -> tuple[str, bool]:
    """(the report's line for a flag, whether it stops the run)."""
    if answer is None:
        return f"{flag}: unknown: not a flag of Megatron-LM's training parser or this engine", True
    if answer.kind == SAME and flag not in megatron_flags():
        return f"{flag}: this engine's own flag (Megatron-LM has none of this name)", False
    if answer.kind == SAME:
        return f"{flag}: implemented (Megatron-LM's meaning)", False
    if answer.kind == NO_EFFECT_KIND:
        problem = value_problem(flag, values[0] if values else None)
        if problem:
            return f"{flag}: refused: {problem}", True
        return f"{flag}: accepted without effect: {answer.why}", False
    definition = megatron_flags()[flag]
    if definition.switch_value is not None:
        value = definition.switch_value
    else:
        value = values[0] if definition.nargs is None and values else values
    if (values or definition.switch_value is not None) and not asks_for_something(flag, value):
        return f"{flag}: accepted without effect: at a value that asks for nothing", False
    kind = "refused" if answer.kind == MISSING_KIND else "refused (not pretraining)"
    line = f"{flag}: {kind}: {refusal(flag, answer).split(': ', 1)[1]}"
    if any("$" in v for v in values):
        line += f" (unless its value is Megatron-LM's default, {definition.default})"
    return line, True


def report(argv: list[str], values_problem, out=print) -> int:
    """Print the report of a command line or script; 0 if it would train, else 2.
    `values_problem(argv)`: the training entry point's own parse and checks of a command line
    (None, or the one line saying what is wrong)."""
    if len(argv) == 1 and argv[0].endswith(".sh") and not os.path.isfile(argv[0]):
        out(f"{argv[0]}: no such script; give an existing script or the flags themselves")
        return 2
    script = read_script_file(argv[0]) if len(argv) == 1 and os.path.isfile(argv[0]) else None
    tokens = list(script.words) if script else argv
    skip = launcher_flags() if script else set()
    implemented = implemented_flags()
    stops = 0
    entry = script.entry if script else None
    if entry is not None and entry not in ("pretrain_gpt.py", "engine.pretrain"):
        out(
            f"{entry}: not pretraining GPT-style models, which is what this engine does (it "
            "runs pretrain_gpt.py's jobs)"
        )
        stops += 1
    for flag, values in flags_with_values(tokens):
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
