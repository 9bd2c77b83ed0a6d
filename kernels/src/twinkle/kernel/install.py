"""How a kernel of each op goes into a module, and how it comes out again.

Every installer sets instance attributes only (a module's ``forward``, a
``MultiLoraLinear``'s ``lora_kernel``), never a class or a parameter, so the
state dict, the optimizer's parameters and other models of the same class are
untouched, and the undo deletes exactly what was set. An installer that cannot
serve a module (another activation, no rotary function to route) says why
instead of installing.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from twinkle.interfaces import Kernel

Undo = Callable[[], None]
Installer = Callable[[nn.Module, Kernel], "Undo | str"]

__all__ = ["INSTALLERS", "Installer", "Undo"]

SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' (ACT2FN["silu"])


def _override_forward(module: nn.Module, forward: Callable[..., Any]) -> Undo:
    module.forward = forward  # an instance attribute shadows the class's forward

    def undo() -> None:
        del module.forward

    return undo


def install_rms_norm(module: nn.Module, kernel: Kernel) -> Undo | str:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor):
        return f"{type(module).__name__} has no weight and epsilon where an RMSNorm keeps them"
    return _override_forward(module, lambda hidden_states: kernel(hidden_states, module.weight, eps))


def install_swiglu(module: nn.Module, kernel: Kernel) -> Undo | str:
    projections = ("gate_proj", "up_proj", "down_proj")
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in projections):
        return f"{type(module).__name__} has no gate_proj, up_proj and down_proj"
    activation = type(getattr(module, "act_fn", None)).__name__
    if activation not in SILU_CLASSES:
        return f"{type(module).__name__} activates with {activation}, not SiLU"

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate_proj, up_proj, down_proj = (getattr(module, name) for name in projections)
        projected: torch.Tensor = down_proj(kernel(gate_proj(x), up_proj(x)))
        return projected

    return _override_forward(module, forward)


# The rotary kernel of the attention module running now, if it was kernelized: transformers' attention
# modules call their modeling file's ``apply_rotary_pos_emb``, so that function is routed through this.
_ACTIVE_ROTARY: contextvars.ContextVar[Kernel | None] = contextvars.ContextVar("twinkle_rotary", default=None)
_ROUTED: dict[str, tuple[Callable[..., Any], int]] = {}  # modeling module → (original function, kernelized users)


def _route_rotary(modeling: Any) -> Undo:
    name = modeling.__name__
    original, users = _ROUTED.get(name, (modeling.apply_rotary_pos_emb, 0))
    if users == 0:

        def routed(*args: Any, **kwargs: Any) -> Any:
            kernel = _ACTIVE_ROTARY.get()
            return (kernel or original)(*args, **kwargs)

        modeling.apply_rotary_pos_emb = routed
    _ROUTED[name] = (original, users + 1)

    def undo() -> None:
        original, users = _ROUTED.pop(name)
        if users > 1:
            _ROUTED[name] = (original, users - 1)
        else:
            modeling.apply_rotary_pos_emb = original

    return undo


def install_rotary(module: nn.Module, kernel: Kernel) -> Undo | str:
    modeling = sys.modules.get(type(module).__module__)
    if not callable(getattr(modeling, "apply_rotary_pos_emb", None)):
        return f"{type(module).__module__} has no apply_rotary_pos_emb to route"
    unroute = _route_rotary(modeling)
    forward = module.forward

    def kernelized_forward(*args: Any, **kwargs: Any) -> Any:
        token = _ACTIVE_ROTARY.set(kernel)
        try:
            return forward(*args, **kwargs)
        finally:
            _ACTIVE_ROTARY.reset(token)

    restore_forward = _override_forward(module, kernelized_forward)

    def undo() -> None:
        restore_forward()
        unroute()

    return undo


def install_multi_lora(module: nn.Module, kernel: Kernel) -> Undo | str:
    if not hasattr(module, "lora_kernel"):
        return f"{type(module).__name__} takes no lora_kernel"
    previous = module.lora_kernel
    # MultiLoraLinear's hook; nn.Module's typing guesses the attribute is a tensor or a module.
    module.lora_kernel = kernel  # type: ignore[assignment]

    def undo() -> None:
        module.lora_kernel = previous

    return undo


INSTALLERS: dict[str, Installer] = {
    "rms_norm": install_rms_norm,
    "swiglu": install_swiglu,
    "rotary": install_rotary,
    "multi_lora": install_multi_lora,
}
