"""Interfaces of the components that change how a model computes, not what: Kernel and Patch.

Both live in their own distributions (``twinkle-kernels``, ``twinkle-patch``); core
only defines what a kernel or a patch is, so models and samplers can take
``kernels=`` / ``patches=`` and users can write their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar


class Kernel(ABC):
    """One operation with a fast implementation on some devices and the PyTorch reference it must equal.

    Calling the kernel runs :meth:`fast` where :meth:`unavailable_reason` is
    ``None`` for the device of the first argument, and :meth:`reference`
    elsewhere, so a model that uses a kernel keeps working on any device.
    ``op`` names the operation (``"rms_norm"``), ``backend`` the implementation
    (``"triton"``, ``"npu"``); several kernels may implement one op.
    """

    op: ClassVar[str]
    backend: ClassVar[str]

    @abstractmethod
    def unavailable_reason(self, device: Any) -> str | None:
        """Why :meth:`fast` cannot run on ``device`` (a missing extra, another device type), or ``None``."""

    @abstractmethod
    def reference(self, *args: Any, **kwargs: Any) -> Any:
        """The operation in plain PyTorch: the definition :meth:`fast` is tested against."""

    @abstractmethod
    def fast(self, *args: Any, **kwargs: Any) -> Any:
        """The operation on the kernel's backend (same arguments and results as :meth:`reference`)."""

    def available(self, device: Any) -> bool:
        return self.unavailable_reason(device) is None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = getattr(args[0], "device", None) if args else None
        return self.fast(*args, **kwargs) if self.available(device) else self.reference(*args, **kwargs)


class Patch(ABC):
    """A reversible fix to a third-party object: a model, one of its modules, or a template.

    :meth:`apply` changes the target and returns the function that undoes
    exactly that change; ``twinkle.patch.apply_patch`` / ``remove_patch`` keep
    track of them. A patch meant for one model family refuses others in
    :meth:`check` with an error that names both.
    """

    name: ClassVar[str]

    def check(self, target: Any) -> None:  # noqa: B027  # optional: a patch that fits any target needs none
        """Raise ``ConfigurationError`` when this patch does not apply to ``target``."""

    @abstractmethod
    def apply(self, target: Any) -> Callable[[], None]:
        """Patch ``target`` (already checked) and return its undo."""
