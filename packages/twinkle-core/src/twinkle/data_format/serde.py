"""Dict round-tripping for the dataclass formats (JSON bodies, checkpoints).

Array fields (numpy, torch) are left as they are: the transport layer decides
how to encode them (the server uses a compact binary encoding, not JSON lists).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from twinkle.errors import InvalidInputError

T = TypeVar("T", bound="Serializable")


class Serializable:
    """Mixin for dataclasses: ``to_dict`` and a strict ``from_dict``."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        if not isinstance(data, dict):
            raise InvalidInputError(f"{cls.__name__} expects a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise InvalidInputError(f"{cls.__name__} got unknown field(s) {unknown}; known: {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as exc:  # missing required fields
            raise InvalidInputError(f"{cls.__name__}: {exc}") from exc


def _plain(value: Any) -> Any:
    if isinstance(value, Serializable):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
