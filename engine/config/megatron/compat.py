"""Megatron-LM's flags that this engine does not implement, on its command line.

engine/config/megatron/answers.py gives each of them an answer; here they are parsed (with the
arity Megatron-LM's parser gives them, engine/config/megatron/releases.py), kept as
`MegatronFlags` (only those given), checked (`check_megatron_flags`: one line, exit code 2, for
the first flag that asks for something missing or not applicable) and named at start
(`no_effect_line`). A refused flag given at Megatron-LM's default value asks for nothing and is
accepted without effect.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from engine.config.megatron.answers import MISSING, NO_EFFECT, NOT_APPLICABLE
from engine.config.megatron.releases import MegatronFlag, megatron_flags
from engine.errors import ConfigError

_PREFIX = "megatron-only:"
SAME, NO_EFFECT_KIND, MISSING_KIND, NOT_APPLICABLE_KIND = (
    "implemented",
    "accepted without effect",
    "refused: missing here",
    "refused: not pretraining",
)


@dataclass(frozen=True)
class Answer:
    kind: str  # SAME, NO_EFFECT_KIND, MISSING_KIND or NOT_APPLICABLE_KIND
    why: str  # the table's group: the reason, the missing feature or the flag's purpose


@functools.cache
def table_answers() -> dict[str, Answer]:
    """{flag: answer} of the flags in the table (each in one group; a test checks)."""
    answers = {}
    for kind, groups in (
        (NO_EFFECT_KIND, NO_EFFECT),
        (MISSING_KIND, MISSING),
        (NOT_APPLICABLE_KIND, NOT_APPLICABLE),
    ):
        for why, flags in groups.items():
            answers.update({flag: Answer(kind, why) for flag in flags})
    return answers


def refusal(flag: str, answer: Answer) -> str:
    """The one line a refused flag gets."""
    if answer.kind == MISSING_KIND:
        return f"{flag}: {answer.why}: not available in this engine; drop {flag}"
    return (
        f"{flag}: {answer.why}: not part of pretraining GPT-style models, which is what this "
        f"engine does; drop {flag}"
    )


@dataclass(frozen=True)
class MegatronFlags:
    """The table's flags a command line gave, with their values (a switch: the value it
    sets), in the order of Megatron-LM's flag list."""

    given: tuple[tuple[str, object], ...] = ()

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, title: str) -> None:
        """A flag for each table entry, as Megatron-LM's parser takes it; not listed in
        --help (docs/megatron_flags.md lists them by answer)."""
        group = parser.add_argument_group(title, "see docs/megatron_flags.md")
        definitions = megatron_flags()
        for flag in table_answers():
            definition = definitions.get(flag)
            if definition is not None:
                group.add_argument(flag, **_argparse_kwargs(definition))

    @staticmethod
    def from_namespace(namespace: argparse.Namespace) -> MegatronFlags:
        values = vars(namespace)
        order = list(megatron_flags())
        given = [(k.removeprefix(_PREFIX), v) for k, v in values.items() if k.startswith(_PREFIX)]
        return MegatronFlags(tuple(sorted(given, key=lambda item: order.index(item[0]))))

    def value(self, flag: str, default=None):
        return dict(self.given).get(flag, default)


def _argparse_kwargs(definition: MegatronFlag) -> dict:
    kwargs = {"dest": _PREFIX + definition.flag, "default": argparse.SUPPRESS}
    kwargs["help"] = argparse.SUPPRESS
    if definition.switch_value is not None:
        return kwargs | {"action": "store_const", "const": definition.switch_value}
    if definition.nargs is not None:
        kwargs["nargs"] = int(definition.nargs) if definition.nargs.isdigit() else definition.nargs
    if definition.choices is not None:
        kwargs["choices"] = list(definition.choices)
    return kwargs


def asks_for_something(flag: str, value) -> bool:
    """Whether a refused flag's value differs from Megatron-LM's default (at the default it
    changes nothing there either)."""
    definition = megatron_flags().get(flag)
    return definition is None or not definition.at_default(value)


def value_problem(flag: str, value, megatron_fsdp: bool = True) -> str | None:
    """Why a flag accepted without effect is refused at this value (None: it is not):
    --ckpt-format other than torch_dist (and fsdp_dtensor with --use-megatron-fsdp)."""
    if flag != "--ckpt-format" or value is None:
        return None
    accepted = ("torch_dist", "fsdp_dtensor") if megatron_fsdp else ("torch_dist",)
    if value in accepted:
        return None
    return (
        f"--ckpt-format {value}: only torch_dist (and fsdp_dtensor with --use-megatron-fsdp) "
        "is accepted (this engine writes its own sharded checkpoints); use torch_dist or leave "
        "it out"
    )


def check_megatron_flags(
    flags: MegatronFlags, position_embedding_type: str, megatron_fsdp: bool = False
) -> None:
    """ConfigError (one line) for the first given flag that asks for a missing feature or for
    something other than pretraining. `megatron_fsdp`: --use-megatron-fsdp is on, with which
    Megatron-LM requires --ckpt-format fsdp_dtensor (accepted then: this engine writes its own
    checkpoints either way)."""
    answers = table_answers()
    for flag, value in flags.given:
        answer = answers[flag]
        if answer.kind in (MISSING_KIND, NOT_APPLICABLE_KIND) and asks_for_something(flag, value):
            raise ConfigError(refusal(flag, answer))
    problem = value_problem("--ckpt-format", flags.value("--ckpt-format"), megatron_fsdp)
    if problem:
        raise ConfigError(problem)
    if (
        flags.value("--no-position-embedding") is False
        and position_embedding_type == "learned_absolute"
    ):
        raise ConfigError(
            "--no-position-embedding goes with --position-embedding-type rope (as in "
            "Megatron-LM); add that flag or drop this one"
        )


def no_effect_line(flags: MegatronFlags, model=None, runtime=None, parallel=None) -> str | None:
    """The one line printed at start naming the Megatron-LM flags accepted without effect
    (the table's, refused ones given at Megatron-LM's default, and --num-query-groups, which
    Megatron-LM reads only with --group-query-attention, --grad-reduce-in-bf16, which it reads
    only with --bf16, and --data-parallel-sharding-strategy, which it reads only with
    --use-megatron-fsdp)."""
    names = [flag for flag, _ in flags.given]
    if model is not None and model.num_query_groups is not None and not model.group_query_attention:
        names.append("--num-query-groups (without --group-query-attention)")
    if runtime is not None and runtime.grad_reduce_in_bf16 and not runtime.bf16:
        names.append("--grad-reduce-in-bf16 (without --bf16)")
    if (
        parallel is not None
        and parallel.data_parallel_sharding_strategy
        and not parallel.use_megatron_fsdp
    ):
        names.append("--data-parallel-sharding-strategy (without --use-megatron-fsdp)")
    if not names:
        return None
    return "Megatron-LM flags accepted without effect here: " + ", ".join(names)
