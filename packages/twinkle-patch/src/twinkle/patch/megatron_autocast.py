"""megatron-core's tensor-parallel linear layers under CPU autocast (``mixed_precision`` on a CPU).

Their autograd functions (``LinearWithFrozenWeight``, ``LinearWithGradAccumulationAndAsyncCommunication``)
are decorated with ``custom_fwd`` / ``custom_bwd`` for CUDA only: the backward re-enters the forward's
autocast on CUDA, never on a CPU. Under CPU autocast the forward multiplies in bfloat16 and the backward
then multiplies a bfloat16 gradient by the float32 weight ("expected scalar type Float but found
BFloat16"). Patched, the same functions record and restore the autocast of ``device_type`` instead. The
change is to megatron's classes, so it holds in the whole process while any model has it applied (one
device type at a time); it ends when the last of them removes it or is collected. ``MegatronModel``
applies it on a CPU with ``mixed_precision``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from twinkle.errors import ConfigurationError
from twinkle.interfaces import Patch
from twinkle.registry import register

FUNCTIONS = ("LinearWithFrozenWeight", "LinearWithGradAccumulationAndAsyncCommunication")


class _Applied:
    """The process's one patch of megatron's classes: for which device, how many targets hold it, what it replaced."""

    device_type: ClassVar[str | None] = None
    holders: ClassVar[int] = 0
    replaced: ClassVar[list[tuple[type, str, Any]]] = []


@register("patch")
class MegatronAutocastPatch(Patch):
    """Megatron's linear autograd functions restore ``device_type``'s autocast in backward (default: the CPU's)."""

    name: ClassVar[str] = "MegatronAutocastPatch"

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type

    def check(self, target: Any) -> None:
        try:
            from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        except ImportError as error:
            raise ConfigurationError(f"{self.name} patches megatron-core, which is not installed") from error
        modules = target.modules() if isinstance(target, torch.nn.Module) else []
        if not any(isinstance(module, (ColumnParallelLinear, RowParallelLinear)) for module in modules):
            raise ConfigurationError(
                f"{self.name} patches models built of megatron-core's parallel linear layers; "
                f"{type(target).__name__} has none"
            )

    def apply(self, target: Any) -> Callable[[], None]:
        if _Applied.holders and _Applied.device_type != self.device_type:
            raise ConfigurationError(
                f"{self.name} is applied for {_Applied.device_type} in this process; it cannot also be for "
                f"{self.device_type} (megatron's classes are shared)"
            )
        if not _Applied.holders:
            _Applied.replaced, _Applied.device_type = _redecorated(self.device_type), self.device_type
        _Applied.holders += 1
        released = False

        def undo() -> None:
            nonlocal released
            if released:
                return
            released = True
            _Applied.holders -= 1
            if not _Applied.holders:
                for function, method, original in reversed(_Applied.replaced):
                    setattr(function, method, original)
                _Applied.replaced, _Applied.device_type = [], None

        weakref.finalize(target, undo)  # a model collected with the patch applied releases it
        return undo


def _redecorated(device_type: str) -> list[tuple[type, str, Any]]:
    """Megatron's linear functions decorated for ``device_type``'s autocast; what they had before."""
    from megatron.core.tensor_parallel import layers

    replaced: list[tuple[type, str, Any]] = []
    for function in (getattr(layers, name) for name in FUNCTIONS):
        for method, decorate in (("forward", torch.amp.custom_fwd), ("backward", torch.amp.custom_bwd)):
            current = function.__dict__[method]
            bare = getattr(current.__func__, "__wrapped__", current.__func__)  # under megatron's decorator
            setattr(function, method, staticmethod(decorate(bare, device_type=device_type)))
            replaced.append((function, method, current))
    return replaced
