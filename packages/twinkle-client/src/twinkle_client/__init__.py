"""Twinkle client: drive a remote Twinkle server with the same API as in-process training.

Change ``from twinkle.X import Y`` to ``from twinkle_client.X import Y``, call
:func:`init_twinkle_client` once, and the training loop runs unchanged: models,
samplers, datasets and data loaders become proxies of server objects, while
rewards, advantages, metrics and preprocessors run locally (none needs torch).

The official ``tinker`` SDK works against the same server after
:func:`init_tinker_client` (``pip install 'twinkle-client[tinker]'``); those
names are loaded on first use, so importing this package never imports ``tinker``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twinkle_client.context import get_client, init_twinkle_client
from twinkle_client.http import TwinkleClient
from twinkle_client.lora import LoraConfig

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from twinkle_client.tinker import datum_to_input_feature, init_tinker_client, input_feature_to_datum, to_tinker_path

__version__ = "0.1.0"

__all__ = [
    "LoraConfig",
    "TwinkleClient",
    "datum_to_input_feature",
    "get_client",
    "init_tinker_client",
    "init_twinkle_client",
    "input_feature_to_datum",
    "to_tinker_path",
]

# Loaded on first use: only code that drives the Tinker SDK pays for them (they import tinker when called).
_TINKER_EXPORTS = frozenset(
    ("datum_to_input_feature", "init_tinker_client", "input_feature_to_datum", "to_tinker_path")
)


def __getattr__(name: str) -> Any:
    if name in _TINKER_EXPORTS:
        from twinkle_client import tinker as tinker_support

        value = getattr(tinker_support, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'twinkle_client' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _TINKER_EXPORTS)
