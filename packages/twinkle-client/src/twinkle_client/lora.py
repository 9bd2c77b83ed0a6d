"""``LoraConfig``: peft.LoraConfig's common fields, so code that drives a remote server needs no peft."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from twinkle.errors import InvalidInputError


@dataclass
class LoraConfig:
    """The LoRA settings a server run accepts; a field left ``None`` takes peft's default on the server.

    Only the fields given are sent, so ``LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")``
    means exactly what ``peft.LoraConfig`` with those arguments means in-process.
    """

    r: int | None = None
    lora_alpha: float | None = None
    target_modules: str | list[str] | None = None
    lora_dropout: float | None = None
    use_rslora: bool | None = None
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, float] | None = None
    init_lora_weights: bool | str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The given fields, as ``peft.LoraConfig`` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def lora_config_dict(config: LoraConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The ``lora_config`` of a new run, from a :class:`LoraConfig` or a dict of its arguments."""
    if isinstance(config, LoraConfig):
        return config.to_dict()
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, str):
        raise InvalidInputError(
            f"adapter config {config!r} is a path: a remote adapter is created from a LoraConfig; "
            "load saved weights into it afterwards with model.load(<checkpoint path from model.save>)"
        )
    raise InvalidInputError(
        f"adapter config must be a twinkle_client.LoraConfig or a dict of its arguments, got {type(config).__name__}"
        " (a peft.LoraConfig is not read remotely: its other fields would be silently dropped)"
    )
