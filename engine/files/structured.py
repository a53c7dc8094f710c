"""A configuration file in YAML (named *.yaml or *.yml) or JSON (anything else), read with
one-line errors that name the flag and the file."""

from __future__ import annotations

import json

from engine.errors import ConfigError


def read_yaml_or_json(path: str, flag: str):
    """The parsed content of the file `flag` names; ConfigError (one line) when it cannot be
    read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(
            f"{flag} {path}: cannot read it ({err.strerror}); give a JSON or YAML file"
        ) from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            first = str(err).strip().splitlines()[0]
            mark = getattr(err, "problem_mark", None)
            where = f", line {mark.line + 1} column {mark.column + 1}" if mark else ""
            raise ConfigError(f"{flag} {path}: not valid YAML ({first}{where}); fix it") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{flag} {path}: not valid JSON ({err.msg}, line {err.lineno}); fix it, or name a "
            "YAML file *.yaml"
        ) from None
