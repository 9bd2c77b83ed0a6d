"""``kernelize``: put kernels into a model by a mapping, report what was replaced, and undo it exactly.

A mapping goes from a module class name (``"Qwen3RMSNorm"``) to what replaces
it: an op name (``"rms_norm"``: the first kernel of that op available on the
model's device, Triton before NPU), a registered kernel name
(``"TritonRMSNorm"``) or a :class:`~twinkle.interfaces.Kernel` instance.
A kernel unavailable on the model's device is not installed: the module keeps
its own forward (the reference the kernel is tested against), and the report
says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from twinkle.errors import ConfigurationError
from twinkle.interfaces import Kernel
from twinkle.kernel.families import DEFAULT_MAPPINGS, OUTPUT_LOGPS, default_mapping
from twinkle.kernel.install import INSTALLERS, Undo
from twinkle.registry import get_registry

__all__ = [
    "KernelReport",
    "ReportEntry",
    "get_kernel_report",
    "kernelize",
    "rekernelize",
    "select_kernel",
    "unkernelize",
]

BACKEND_ORDER = ("triton", "npu")
_REPORT_ATTRIBUTE = "_twinkle_kernel_report"  # set on the kernelized model, deleted by unkernelize


@dataclass(frozen=True)
class ReportEntry:
    """What became of one target: ``kernel`` is the installed kernel's name, or ``None`` with the ``reason``."""

    target: str
    op: str
    modules: tuple[str, ...]
    kernel: str | None
    reason: str | None = None


@dataclass
class KernelReport:
    """One entry per mapping target, in mapping order; ``kernels`` maps function targets to their kernel."""

    mapping: dict[str, str | Kernel] = field(default_factory=dict)
    entries: list[ReportEntry] = field(default_factory=list)
    kernels: dict[str, Kernel] = field(default_factory=dict)
    _undo: list[Undo] = field(default_factory=list, repr=False)

    @property
    def replaced(self) -> dict[str, str]:
        """``{target: kernel name}`` of what was replaced."""
        return {entry.target: entry.kernel for entry in self.entries if entry.kernel is not None}

    def __str__(self) -> str:
        lines = []
        for entry in self.entries:
            where = "function" if entry.target == OUTPUT_LOGPS else f"{len(entry.modules)} modules"
            done = f"→ {entry.kernel}" if entry.kernel else f"kept (falls back: {entry.reason})"
            lines.append(f"{entry.target} [{entry.op}, {where}] {done}")
        return "\n".join(lines) or "nothing kernelized"


def _registered_kernels() -> list[Kernel]:
    registry = get_registry("kernel")
    return [registry.build(registry.get(name)) for name in registry.names()]


def select_kernel(spec: str | Kernel, device: Any) -> tuple[Kernel | None, str, str | None]:
    """``(kernel or None, op, reason)`` for a mapping value on ``device`` (see the module docstring)."""
    if isinstance(spec, Kernel):
        return (spec, spec.op, None) if spec.available(device) else (None, spec.op, spec.unavailable_reason(device))
    kernels = _registered_kernels()
    named = [kernel for kernel in kernels if type(kernel).__name__ == spec]
    if named:
        return select_kernel(named[0], device)
    of_op = [kernel for kernel in kernels if kernel.op == spec]
    if not of_op:
        ops = sorted({kernel.op for kernel in kernels})
        raise ConfigurationError(f"unknown kernel or op {spec!r}; ops: {ops}; kernels: {sorted(map(_name, kernels))}")
    of_op.sort(key=lambda kernel: BACKEND_ORDER.index(kernel.backend) if kernel.backend in BACKEND_ORDER else 99)
    reasons = []
    for kernel in of_op:
        reason = kernel.unavailable_reason(device)
        if reason is None:
            return kernel, spec, None
        reasons.append(f"{_name(kernel)}: {reason}")
    return None, spec, "; ".join(reasons)


def _name(kernel: Kernel) -> str:
    return type(kernel).__name__


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "get_base_model"):  # a PEFT wrapper
        config = getattr(model.get_base_model(), "config", None)  # type: ignore[operator]  # PEFT's method
    return str(getattr(config, "model_type", type(model).__name__))


def kernelize(model: nn.Module, mapping: Mapping[str, str | Kernel] | None = None) -> KernelReport:
    """Replace ``model``'s modules by ``mapping`` (default: its family's, see ``twinkle.kernel.families``).

    Returns the report (also kept on the model for :func:`get_kernel_report`).
    :func:`unkernelize` restores every module exactly.
    """
    if get_kernel_report(model) is not None:
        raise ConfigurationError(f"{type(model).__name__} is already kernelized; unkernelize it first")
    if mapping is None:
        model_type = _model_type(model)
        mapping = default_mapping(model_type)
        if not mapping:
            raise ConfigurationError(
                f"no default kernel mapping for model type {model_type!r} (families: {sorted(DEFAULT_MAPPINGS)}); "
                "pass mapping={module class name: op or kernel}"
            )
    device = next(model.parameters()).device
    report = KernelReport(dict(mapping))
    try:
        for target, spec in mapping.items():
            report.entries.append(_kernelize_target(model, target, spec, device, report))
    except BaseException:
        _undo(report)
        raise
    setattr(model, _REPORT_ATTRIBUTE, report)
    return report


def _kernelize_target(
    model: nn.Module, target: str, spec: str | Kernel, device: Any, report: KernelReport
) -> ReportEntry:
    kernel, op, reason = select_kernel(spec, device)
    if target == OUTPUT_LOGPS:
        if kernel is not None:
            report.kernels[target] = kernel
        return ReportEntry(target, op, (), None if kernel is None else _name(kernel), reason)
    installer = INSTALLERS.get(op)
    if installer is None:
        raise ConfigurationError(f"op {op!r} replaces no module; ops that do: {sorted(INSTALLERS)}")
    names = tuple(name for name, module in model.named_modules() if type(module).__name__ == target)
    if not names:
        return ReportEntry(target, op, (), None, f"{type(model).__name__} has no {target} module")
    if kernel is None:
        return ReportEntry(target, op, names, None, reason)
    undos: list[Undo] = []
    for name in names:
        undo = installer(model.get_submodule(name), kernel)
        if isinstance(undo, str):  # the target's modules share a class, so the first one refuses
            for installed in reversed(undos):
                installed()
            return ReportEntry(target, op, names, None, undo)
        undos.append(undo)
    report._undo.extend(undos)
    return ReportEntry(target, op, names, _name(kernel))


def get_kernel_report(model: nn.Module) -> KernelReport | None:
    """What :func:`kernelize` replaced in ``model`` (``None`` when it is not kernelized)."""
    report: KernelReport | None = getattr(model, _REPORT_ATTRIBUTE, None)
    return report


def rekernelize(model: nn.Module) -> KernelReport | None:
    """Kernelize ``model`` again with its mapping, so modules added since (a new adapter's layers) get kernels too.

    Returns the new report (``None``, doing nothing, on a model never kernelized).
    """
    report = get_kernel_report(model)
    if report is None:
        return None
    unkernelize(model)
    return kernelize(model, report.mapping)


def unkernelize(model: nn.Module) -> None:
    """Undo :func:`kernelize`: every module is as it was before (a no-op on a model never kernelized)."""
    report = get_kernel_report(model)
    if report is not None:
        _undo(report)
        delattr(model, _REPORT_ATTRIBUTE)


def _undo(report: KernelReport) -> None:
    while report._undo:
        report._undo.pop()()
