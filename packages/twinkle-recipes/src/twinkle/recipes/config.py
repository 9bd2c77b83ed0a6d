"""Recipe configuration: dataclass defaults < YAML file < command-line flags.

Every dataclass field becomes a flag (``--lr 1e-4``, ``--lora null``); flag
values are parsed as YAML, so numbers, booleans, ``null`` and inline mappings
(``--lora '{r: 8, lora_alpha: 16}'``) work without per-field parsing code.
YAML 1.1 reads ``1e-4`` (no dot) as a string, so text given for a numeric
option is converted to a number.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from twinkle.errors import ConfigurationError

C = TypeVar("C")


def load_config(cls: type[C], argv: Sequence[str], prog: str, description: str) -> C:
    """Build ``cls`` from ``--config FILE`` and per-field flags in ``argv``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, help="YAML file with any of the options below")
    for name, field in fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            metavar="VALUE",
            help=f"default: {_default(field)!r}",
        )
    args = parser.parse_args(list(argv))
    values: dict[str, Any] = {}
    if args.config is not None:
        values.update(_read_yaml(args.config, fields))
    for name in fields:
        raw = getattr(args, name)
        if raw is not None:
            values[name] = yaml.safe_load(raw)
    defaults = {name: _default(field) for name, field in fields.items()}
    values = {name: _numeric(value, defaults[name], name) for name, value in values.items()}
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigurationError(f"{prog}: {exc}") from exc


def _read_yaml(path: Path, fields: dict[str, Any]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigurationError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigurationError(f"config file {path} must hold a mapping of option: value")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigurationError(f"config file {path} has unknown option(s) {unknown}; known: {sorted(fields)}")
    return data


def _default(field: dataclasses.Field[Any]) -> Any:
    """A config field's default (every recipe option has one)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if callable(field.default_factory):
        return field.default_factory()
    raise TypeError(f"recipe option {field.name} has no default")


def _numeric(value: Any, default: Any, name: str) -> Any:
    """``'1e-4'`` for a float option becomes ``0.0001``; anything else is left for the config to validate."""
    if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return type(default)(value) if isinstance(default, float) else int(value)
        except ValueError:
            raise ConfigurationError(f"option {name} expects a number, got {value!r}") from None
    return value
