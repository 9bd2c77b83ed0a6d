"""Name → component registries, one per component kind.

Every ``set_*`` argument and factory in Twinkle goes through :func:`build`:
it accepts an instance, a class, a registered name, an entry-point name from
the group ``twinkle.<kind>``, or an import path ``"package.module:Name"``.
Built-in components are published through the same entry points by the
distribution that ships them, so a package can resolve ``'GRPOLoss'`` without
importing ``twinkle.loss`` itself, and a third-party plugin needs nothing else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar, overload

from twinkle.errors import ComponentNotFoundError, ConfigurationError

__all__ = ["KINDS", "Registry", "build", "factory", "get_registry", "register"]

T = TypeVar("T")

KINDS: tuple[str, ...] = (
    "dataset",
    "template",
    "preprocessor",
    "processor",
    "dataloader",
    "model",
    "sampler",
    "loss",
    "advantage",
    "reward",
    "metric",
    "tool_parser",
    "env",
    "checkpoint_engine",
    "optimizer",
    "lr_scheduler",
    "kernel",
    "patch",
)


class Registry:
    """Components of one kind, by name. Entry points are read lazily on a miss."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entry_point_group = f"twinkle.{kind}"
        self._items: dict[str, Any] = {}

    @overload
    def register(self, obj: None = None, *, name: str | None = None) -> Callable[[T], T]: ...
    @overload
    def register(self, obj: T, *, name: str | None = None) -> T: ...
    def register(self, obj: T | None = None, *, name: str | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name`` (default: its ``__name__``); usable as a decorator."""

        def decorator(target: T) -> T:
            key = name or getattr(target, "__name__", None)
            if not key:
                raise ConfigurationError(f"cannot register {target!r} in {self.kind!r}: give it a name")
            existing = self._items.get(key)
            if existing is not None and existing is not target:
                raise ConfigurationError(f"{self.kind} {key!r} is already registered as {existing!r}")
            self._items[key] = target
            return target

        return decorator if obj is None else decorator(obj)

    def _entry_points(self) -> dict[str, Any]:
        return {ep.name: ep for ep in entry_points(group=self.entry_point_group)}

    def names(self) -> list[str]:
        """Every name that resolves: registered in this process or published as an entry point."""
        return sorted(set(self._items) | set(self._entry_points()))

    def get(self, name: str) -> Any:
        """The class or factory registered as ``name``."""
        if name in self._items:
            return self._items[name]
        if ":" in name:
            return _import_path(name, self.kind)
        ep = self._entry_points().get(name)
        if ep is None:
            raise ComponentNotFoundError(
                f"unknown {self.kind} {name!r}; available: {', '.join(self.names()) or 'none'}"
            )
        self._items[name] = ep.load()
        return self._items[name]

    def build(self, spec: Any, /, **kwargs: Any) -> Any:
        """Resolve ``spec`` (instance, class, factory, or name) to an instance.

        An existing instance is returned as is; passing kwargs with one is an
        error rather than being silently ignored.
        """
        if isinstance(spec, str):
            spec = self.get(spec)
        if isinstance(spec, type) or (callable(spec) and _is_factory(spec)):
            try:
                return spec(**kwargs)
            except TypeError as exc:
                raise ConfigurationError(
                    f"cannot build {self.kind} {_name(spec)} with {sorted(kwargs)}: {exc}"
                ) from exc
        if kwargs:
            raise ConfigurationError(
                f"{self.kind} {_name(spec)} is already an instance; arguments {sorted(kwargs)} would be ignored"
            )
        return spec


def _is_factory(obj: Callable[..., Any]) -> bool:
    """Plain functions registered as factories; callable *instances* are components themselves."""
    return getattr(obj, "__twinkle_factory__", False)


def factory(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark a function as a component factory (called by :meth:`Registry.build`)."""
    fn.__twinkle_factory__ = True  # type: ignore[attr-defined]
    return fn


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", type(obj).__name__)


def _import_path(path: str, kind: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ComponentNotFoundError(f"cannot import {kind} {path!r}: {exc}") from exc


_REGISTRIES: dict[str, Registry] = {kind: Registry(kind) for kind in KINDS}


def get_registry(kind: str) -> Registry:
    """The registry of one component kind (see :data:`KINDS`)."""
    try:
        return _REGISTRIES[kind]
    except KeyError:
        raise ComponentNotFoundError(f"unknown component kind {kind!r}; known: {', '.join(KINDS)}") from None


@overload
def register(kind: str, obj: None = None, *, name: str | None = None) -> Callable[[T], T]: ...
@overload
def register(kind: str, obj: T, *, name: str | None = None) -> T: ...
def register(kind: str, obj: T | None = None, *, name: str | None = None) -> Callable[[T], T] | T:
    """``@register('loss')`` or ``register('loss', MyLoss, name='my_loss')``."""
    return get_registry(kind).register(obj, name=name)


def build(kind: str, spec: Any, /, **kwargs: Any) -> Any:
    """Resolve a component of ``kind`` from an instance, class, factory or name."""
    return get_registry(kind).build(spec, **kwargs)
