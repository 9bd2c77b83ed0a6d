"""Optimizers by name: every ``torch.optim`` optimizer, plus ``'default'`` (AdamW).

Registered under the ``optimizer`` kind so ``set_optimizer('AdamW', lr=1e-4)``,
``set_optimizer(torch.optim.SGD, lr=0.1)`` and plugins resolve the same way.
"""

from __future__ import annotations

import inspect
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
    params = [_listed(group) if isinstance(group, dict) else group for group in params]  # read twice below
    if _fusable_on_cpu(cls, params, kwargs):
        kwargs = {**kwargs, "fused": True}
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"cannot build optimizer {cls.__name__} with {kwargs}: {exc}") from exc


def _listed(group: dict[str, Any]) -> dict[str, Any]:
    tensors = group["params"]
    return {**group, "params": [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)}


# The implementation choices a caller may make; none given, the CPU default below applies.
_IMPLEMENTATION_OPTIONS = ("fused", "foreach", "differentiable", "capturable")


def keeping_implementation(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``state`` (an ``optimizer.state_dict()`` to load) with ``optimizer``'s own implementation choices.

    They belong to the process, not to the training state: a checkpoint written where the fused CPU kernel was
    chosen must not ask for it where the parameters are DTensors or on an accelerator.
    """
    groups = [
        {**saved, **{key: own[key] for key in _IMPLEMENTATION_OPTIONS if key in own}}
        for saved, own in zip(state["param_groups"], optimizer.param_groups, strict=False)
    ]
    return {**state, "param_groups": groups + state["param_groups"][len(groups) :]}


def _fusable_on_cpu(cls: type[torch.optim.Optimizer], params: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether to ask for the fused kernel: on a CPU ``torch.optim`` otherwise steps one tensor at a time.

    Fused, an AdamW step over a LoRA adapter's 56 tensors takes 0.27 ms instead of 1.3 ms, with the same
    results up to rounding. Only where the caller chose no implementation, the optimizer has a fused one,
    and every parameter is a plain CPU floating-point tensor (not a DTensor of FSDP2, not on an accelerator,
    where PyTorch picks its own default).
    """
    if any(option in kwargs for option in _IMPLEMENTATION_OPTIONS):
        return False
    if "fused" not in inspect.signature(cls.__init__).parameters:
        return False
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(
        isinstance(p, torch.Tensor)
        and type(p.detach()) is torch.Tensor
        and p.device.type == "cpu"
        and p.is_floating_point()
        and not p.is_sparse
        for p in tensors
    )
