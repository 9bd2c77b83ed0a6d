"""Optimizers by name: every ``torch.optim`` optimizer, plus ``'default'`` (AdamW).

Registered under the ``optimizer`` kind so ``set_optimizer('AdamW', lr=1e-4)``,
``set_optimizer(torch.optim.SGD, lr=0.1)`` and plugins resolve the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from twinkle.errors import ComponentNotFoundError, ConfigurationError
from twinkle.registry import get_registry

DEFAULT_OPTIMIZER = "AdamW"


def optimizer_class(spec: str | type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Resolve an optimizer class from a class, ``'default'``, a ``torch.optim`` name, or a registered name."""
    if isinstance(spec, type):
        if not issubclass(spec, torch.optim.Optimizer):
            raise ConfigurationError(f"{spec.__name__} is not a torch.optim.Optimizer subclass")
        return spec
    name = DEFAULT_OPTIMIZER if spec == "default" else spec
    candidate = getattr(torch.optim, name, None)
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer):
        return candidate
    try:
        registered: type[torch.optim.Optimizer] = get_registry("optimizer").get(name)
    except ComponentNotFoundError:
        known = sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type) and n[0].isupper())
        raise ComponentNotFoundError(
            f"unknown optimizer {spec!r}; use a torch.optim name ({', '.join(known)}) or a registered optimizer"
        ) from None
    return registered


def build_optimizer(
    spec: str | type[torch.optim.Optimizer] | torch.optim.Optimizer,
    params: Iterable[torch.nn.Parameter],
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Instantiate an optimizer over ``params``; bad hyper-parameters become ConfigurationError."""
    if isinstance(spec, torch.optim.Optimizer):
        raise ConfigurationError(
            "pass an optimizer class or name, not an instance: it must own this model's parameters"
        )
    cls = optimizer_class(spec)
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"cannot build optimizer {cls.__name__} with {kwargs}: {exc}") from exc
