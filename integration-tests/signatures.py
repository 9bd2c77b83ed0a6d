"""Comparing classes by their public methods' signatures: interface conformance and client parity.

Both checks read ``inspect.signature`` of the methods as the class defines
them (``self`` dropped) and compare parameter names, kinds (positional,
keyword-only, ``*args``, ``**kwargs``) and defaults; annotations are left to
the type checker. Each function returns a list of problems, empty when the
classes agree, so a test can show every drift at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

# Dunder methods that are part of a component's API (iteration, length, indexing, calling).
API_DUNDERS = frozenset({"__call__", "__len__", "__iter__", "__getitem__"})
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_PROTOCOL_INTERNALS = frozenset({"_is_protocol", "_is_runtime_protocol", "__protocol_attrs__"})


def is_api_name(name: str) -> bool:
    return not name.startswith("_") or name in API_DUNDERS


def declared_members(interface: type) -> dict[str, Any]:
    """What ``interface`` (a Protocol or ABC, with its interface bases) declares: methods, properties, attributes.

    Attributes declared by annotation only (``max_length: int | None``) map to ``None``.
    """
    members: dict[str, Any] = {}
    for klass in reversed(interface.__mro__):
        if klass.__module__ in ("builtins", "typing", "abc"):
            continue
        for name in inspect.get_annotations(klass):
            if is_api_name(name):
                members.setdefault(name, None)
        for name, value in klass.__dict__.items():
            if is_api_name(name) and name not in _PROTOCOL_INTERNALS:
                members[name] = value
    return members


def parameters(cls: type, name: str) -> list[inspect.Parameter]:
    """The parameters of method ``name`` of ``cls`` as a caller sees them (without ``self``/``cls``)."""
    raw = inspect.getattr_static(cls, name)
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    params = list(inspect.signature(function).parameters.values())
    return params if isinstance(raw, staticmethod) else params[1:]


def is_method(cls: type, name: str) -> bool:
    raw = inspect.getattr_static(cls, name)
    return inspect.isfunction(raw) or isinstance(raw, (staticmethod, classmethod))


def member_problems(interface: type, cls: type) -> list[str]:
    """Every way ``cls`` fails to provide what ``interface`` declares, each naming the member."""
    problems = []
    for name, declared in declared_members(interface).items():
        where = f"{cls.__name__}.{name}"
        if isinstance(declared, property):
            if not isinstance(inspect.getattr_static(cls, name, None), property):
                problems.append(f"{where}: the interface declares a property, the class has none")
        elif inspect.isfunction(declared):
            if not hasattr(cls, name) or not is_method(cls, name):
                problems.append(f"{where}: missing method")
            else:
                problems += compatibility_problems(parameters(interface, name), parameters(cls, name), where)
        elif not _has_attribute(cls, name):
            problems.append(f"{where}: missing attribute (not a class attribute nor a constructor argument)")
    return problems


def _has_attribute(cls: type, name: str) -> bool:
    if hasattr(cls, name) or any(name in inspect.get_annotations(klass) for klass in cls.__mro__):
        return True
    return name in inspect.signature(cls.__init__).parameters


def compatibility_problems(
    declared: list[inspect.Parameter], implemented: list[inspect.Parameter], where: str
) -> list[str]:
    """Can every call written against ``declared`` be made to ``implemented``, meaning the same thing?

    The interface's named parameters must be there with the same names,
    positions, kinds, required-ness and defaults, and its ``*args``/``**kwargs``
    too; an implementation's extra parameters must be optional. An interface
    that ends in ``*args: Any, **kwargs: Any`` leaves the rest to each
    implementation (a metric's values, an advantage's inputs), as type checkers do.
    """
    problems = []
    by_name = {p.name: p for p in implemented}
    variadic = {p.kind for p in declared} & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    open_ended = len(variadic) == 2
    declared_positional = [p for p in declared if p.kind in _POSITIONAL]
    implemented_positional = [p for p in implemented if p.kind in _POSITIONAL]
    for index, param in enumerate(declared_positional):
        if index >= len(implemented_positional):
            problems.append(f"{where}: no positional parameter {index}, the interface's {param.name!r}")
        elif implemented_positional[index].name != param.name:
            actual = implemented_positional[index].name
            problems.append(f"{where}: positional parameter {index} is {actual!r}, the interface's is {param.name!r}")
    for param in declared:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            star = "*" if param.kind == param.VAR_POSITIONAL else "**"
            if not open_ended and not any(p.kind == param.kind for p in implemented):
                problems.append(f"{where}: the interface takes {star}{param.name}, the implementation does not")
            continue
        other = by_name.get(param.name)
        if other is None:
            if param.kind == param.KEYWORD_ONLY:
                problems.append(f"{where}: missing keyword parameter {param.name!r}")
            continue
        if param.kind == param.KEYWORD_ONLY and other.kind not in _KEYWORD:
            problems.append(f"{where}: {param.name!r} must be accepted as a keyword")
        problems += _default_problems(param, other, where)
    if open_ended:
        return problems
    declared_names = {p.name for p in declared}
    for param in implemented:
        if param.name in declared_names or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            problems.append(f"{where}: extra required parameter {param.name!r} that the interface does not declare")
    return problems


def _default_problems(declared: inspect.Parameter, implemented: inspect.Parameter, where: str) -> list[str]:
    if (declared.default is declared.empty) != (implemented.default is implemented.empty):
        state = "required" if implemented.default is implemented.empty else f"optional (= {implemented.default!r})"
        wanted = "required" if declared.default is declared.empty else f"optional (= {declared.default!r})"
        return [f"{where}: {declared.name!r} is {state}, the interface's is {wanted}"]
    if declared.default is not declared.empty and not _same_default(declared.default, implemented.default):
        return [
            f"{where}: {declared.name!r} defaults to {implemented.default!r}, the interface's to {declared.default!r}"
        ]
    return []


def _same_default(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # e.g. arrays, whose == is elementwise
        return a is b


def parity_problem(reference: list[inspect.Parameter], twin: list[inspect.Parameter]) -> str | None:
    """``None`` for the same parameters in the same order, kinds and defaults (``*args``/``**kwargs`` names aside)."""

    def shape(param: inspect.Parameter) -> tuple[Any, ...]:
        variadic = param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        return ("*" if variadic else param.name, param.kind.name, _default_repr(param))

    ours, theirs = [shape(p) for p in reference], [shape(p) for p in twin]
    return None if ours == theirs else f"in-process {ours} != client {theirs}"


def _default_repr(param: inspect.Parameter) -> str:
    return "required" if param.default is param.empty else repr(param.default)


def api_names(cls: type) -> set[str]:
    """The public methods and properties of ``cls`` (data attributes and constants left out)."""
    names = set()
    for name in dir(cls):
        if not is_api_name(name):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, property) or is_method(cls, name):
            names.add(name)
    return names


def callable_parameters(obj: Callable[..., Any]) -> list[inspect.Parameter]:
    """A factory function's or a class constructor's parameters (``self`` left out)."""
    return list(inspect.signature(obj).parameters.values())
