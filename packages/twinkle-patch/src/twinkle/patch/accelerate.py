"""``accelerate``: what a model's or a sampler's ``kernels=`` and ``patches=`` arguments do to its model.

Patches go first (a patch may replace a forward a kernel then wraps), then
:func:`twinkle.kernel.kernelize`. Models call
:func:`twinkle.kernel.rekernelize` when they add modules (a new adapter's
layers), so those get kernels too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from twinkle.errors import ConfigurationError
from twinkle.interfaces import Kernel
from twinkle.kernel import KernelReport, kernelize
from twinkle.patch.apply import PatchSpec, apply_patch, remove_patch

__all__ = ["KernelsSpec", "accelerate"]

# False / None: no kernel; True: the model family's default mapping; a mapping: {module class name: op or kernel}.
KernelsSpec = bool | Mapping[str, str | Kernel] | None


def accelerate(
    model: nn.Module, kernels: KernelsSpec = False, patches: Sequence[PatchSpec] = ()
) -> KernelReport | None:
    """Apply ``patches`` (in order) and then ``kernels`` to ``model``; returns the kernel report, if kernelized.

    On any error nothing stays applied.
    """
    if not (kernels is None or isinstance(kernels, (bool, Mapping))):
        raise ConfigurationError(
            f"kernels must be True (the model family's defaults), False or a mapping "
            f"{{module class name: op or kernel}}, got {kernels!r}"
        )
    if isinstance(patches, (str, bytes)):
        raise ConfigurationError(f"patches must be a list of patches, got the string {patches!r}")
    applied = []
    try:
        for patch in patches:
            applied.append(apply_patch(model, patch))
        if not kernels:
            return None
        return kernelize(model, None if kernels is True else kernels)
    except BaseException:
        for patch in reversed(applied):
            remove_patch(model, patch)
        raise
