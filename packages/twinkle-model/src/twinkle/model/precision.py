"""``mixed_precision``: the dtype the forward runs under autocast (weights keep the dtype they were loaded in)."""

from __future__ import annotations

from typing import Literal

import torch

from twinkle.errors import ConfigurationError

MixedPrecision = Literal["no", "bf16", "fp16"]
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_mixed_precision(mixed_precision: str) -> None:
    if mixed_precision not in ("no", *_AUTOCAST_DTYPES):
        raise ConfigurationError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {mixed_precision!r}")


def autocast(device_type: str, mixed_precision: MixedPrecision) -> torch.autocast:
    """Autocast to ``mixed_precision``'s dtype on ``device_type``; disabled for ``'no'``."""
    return torch.autocast(device_type, dtype=_AUTOCAST_DTYPES.get(mixed_precision), enabled=mixed_precision != "no")
