"""Command line -> config dataclasses, with Megatron-LM's flag names.

Flags are generated from the fields of the dataclasses in engine/config/ (a field `hidden_size`
becomes `--hidden-size`, unless its metadata names another flag), one argparse group per
dataclass, so `--help` lists them grouped and the configs stay the single source of truth. A
class with `add_arguments(parser, title)` and `from_namespace(namespace)` adds and reads its
own flags (engine/config/megatron/compat.py: Megatron-LM's flags this engine does not
implement).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing

from engine.errors import ConfigError


def flag_of(field: dataclasses.Field) -> str:
    """The command-line flag of a config field (--field-name unless its metadata names one)."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def flags_of(field: dataclasses.Field) -> tuple[str, ...]:
    """Every flag that sets a config field: its own, its `aliases` (other names Megatron-LM
    gives the same flag) and its `switches` (Megatron-LM's flags that set it to one value)."""
    meta = field.metadata
    return (flag_of(field), *meta.get("aliases", ()), *meta.get("switches", {}))


def _base_type(annotation) -> tuple[type, bool]:
    """(element type, is_list) of int / float / str / bool / X | None / list[X]."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, title: str) -> None:
    """One argparse group holding a flag for every field of dataclass `cls`."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata:
            continue
        meta = dict(field.metadata)
        flag = flag_of(field)
        kwargs = {
            "dest": f"{cls.__name__}.{field.name}",
            "help": meta.pop("help").replace("%", "%%"),
        }
        meta.pop("flag", None)
        meta.pop("required", None)  # checked after parsing (see missing_required)
        aliases = meta.pop("aliases", ())
        switches = meta.pop("switches", {})
        element, is_list = _base_type(hints[field.name])
        if element is bool:
            kwargs["action"] = meta.pop("action", "store_true")
        else:
            kwargs["type"] = element
            if is_list:
                kwargs["nargs"] = meta.pop("nargs", "+")
        kwargs.update(meta)
        kwargs["default"] = argparse.SUPPRESS
        group.add_argument(flag, *aliases, **kwargs)
        for switch, value in switches.items():  # applied after the other flags (build_configs)
            group.add_argument(
                switch,
                dest=f"{kwargs['dest']}@{switch}",
                action="store_const",
                const=value,
                default=argparse.SUPPRESS,
                help=f"Megatron-LM's older spelling of {flag} {value}".replace("%", "%%"),
            )


def build_configs(namespace: argparse.Namespace, classes: list[type]) -> dict[type, object]:
    """Instantiate each dataclass from the parsed flags (unset flags keep field defaults); a
    class that adds its own arguments makes itself from the namespace (`from_namespace`)."""
    values: dict[str, dict] = {cls.__name__: {} for cls in classes}
    switched = []
    for key, value in vars(namespace).items():
        owner, _, name = key.partition(".")
        if owner in values and "@" in name:  # a switch wins whatever the order, as there
            switched.append((owner, name.split("@", 1)[0], value))
        elif owner in values:
            values[owner][name] = value
    for owner, name, value in switched:
        values[owner][name] = value
    return {
        cls: cls.from_namespace(namespace)
        if hasattr(cls, "from_namespace")
        else cls(**values[cls.__name__])
        for cls in classes
    }


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (inf or nan would train a NaN model)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; give one such as 1e-4")
    return value


finite_float.__name__ = "float"  # argparse names the type in "invalid float value: 'x'"

# argparse takes "-1e-3" for a flag (its own pattern knows -1 and -0.001 only): every form of a
# negative number is a value here.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (exit code 2) naming the fix, reads
    negative numbers in any notation as values and takes only finite numbers for `type=float`.
    Every command line of the project (the engine's and the tools') is parsed by one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER
        self.register("type", float, finite_float)

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"error: {message}; see --help\n")


def make_parser(classes: list[tuple[type, str]], description: str | None = None) -> ArgumentParser:
    parser = ArgumentParser(description=description, allow_abbrev=False)
    for cls, title in classes:
        if hasattr(cls, "add_arguments"):  # a class whose flags are not its fields
            cls.add_arguments(parser, title)
        else:
            add_dataclass_arguments(parser, cls, title)
    return parser


def missing_required(namespace: argparse.Namespace, configs: dict[type, object]) -> list[str]:
    """Flags Megatron-LM requires that were not given. A field's metadata `required` is True,
    or the name of a boolean field (of any config) that waives it when set (the model's shape
    is not required with --use-checkpoint-args, which takes it from the checkpoint)."""
    given = set(vars(namespace))
    missing = []
    for cls in configs:
        for field in dataclasses.fields(cls):
            rule = field.metadata.get("required")
            if not rule or f"{cls.__name__}.{field.name}" in given:
                continue
            if isinstance(rule, str) and any(getattr(c, rule, False) for c in configs.values()):
                continue
            missing.append(flag_of(field))
    return missing


def parse_configs(
    argv: list[str] | None,
    classes: list[tuple[type, str]],
    description=None,
    enforce_required: bool = False,
):
    """Parse argv into {class: instance}; later repetitions of a flag override earlier ones.
    With enforce_required (the training entry point), ConfigError (one line) naming the flags
    Megatron-LM requires that are missing."""
    parser = make_parser(classes, description)
    namespace = parser.parse_args(argv)
    try:
        configs = build_configs(namespace, [cls for cls, _ in classes])
    except TypeError as err:
        raise ConfigError(str(err)) from None
    missing = missing_required(namespace, configs) if enforce_required else []
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (as in "
            "Megatron-LM); see --help"
        )
    return configs


def other_names(classes: list[tuple[type, str]]) -> dict[str, str]:
    """{alias or switch: the field's own flag} of the configs' fields."""
    names = {}
    for cls, _ in classes:
        if not dataclasses.is_dataclass(cls):
            continue
        for field in dataclasses.fields(cls):
            for name in flags_of(field)[1:]:
                names[name] = flag_of(field)
    return names


def given_flags(argv: list[str], aliases: dict[str, str] | None = None) -> frozenset[str]:
    """The flags on a command line (`--seq-length 64` and `--seq-length=64` alike), with the
    own flag of each alias given (`aliases`: other_names)."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    aliases = aliases or {}
    return frozenset(flags | {aliases[f] for f in flags if f in aliases})


def check_aliases(argv: list[str], classes: list[tuple[type, str]]) -> None:
    """ConfigError when a field is given under two of its names (Megatron-LM refuses
    --num-layers beside --encoder-num-layers, which name the same value; a switch such as
    --recompute-activations beside --recompute-granularity is not refused: it wins)."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    for cls, _ in classes:
        if not dataclasses.is_dataclass(cls):
            continue
        for field in dataclasses.fields(cls):
            names = [n for n in (flag_of(field), *field.metadata.get("aliases", ())) if n in flags]
            if len(names) > 1:
                raise ConfigError(
                    f"{' and '.join(names)} both given: they set the same value; keep one"
                )
