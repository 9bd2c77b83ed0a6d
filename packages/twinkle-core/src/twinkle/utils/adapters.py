"""Which adapter a call means when the caller may leave ``adapter_name`` out."""

from __future__ import annotations

from collections.abc import Sequence

from twinkle.errors import ConfigurationError


def pick_adapter(names: Sequence[str], adapter_name: str | None) -> str | None:
    """``adapter_name`` checked against ``names``; by default the only adapter, or None when there is none."""
    names = list(names)
    if adapter_name is not None and adapter_name not in names:
        raise ConfigurationError(f"the model has no adapter {adapter_name!r}; adapters: {names}")
    if adapter_name is None and len(names) > 1:
        raise ConfigurationError(f"the model has several adapters {names}: pass adapter_name=")
    return adapter_name if adapter_name is not None else (names[0] if names else None)
