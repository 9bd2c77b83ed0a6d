"""Components named for the server: a registered name, a class, a module-level function, or an instance.

The server builds components from its registry (``twinkle.registry``), so what
travels is a name plus constructor arguments. An instance is sent as its class
name and the arguments read back from its attributes (``SelfCognitionProcessor('A', 'B')``
keeps ``model_name``/``model_author``); code cannot travel, so lambdas and
functions defined inside other functions are refused with a pointer to the fix.
"""

from __future__ import annotations

import inspect
from typing import Any

from twinkle.errors import ConfigurationError, InvalidInputError


def component_spec(component: Any, where: str) -> tuple[str, dict[str, Any]]:
    """``(registered name, constructor kwargs)`` of ``component``; ``where`` names the call in errors."""
    if isinstance(component, str):
        return component, {}
    if isinstance(component, type):
        return component.__name__, {}
    if inspect.isfunction(component) or inspect.isbuiltin(component):
        if component.__name__ == "<lambda>" or "<locals>" in component.__qualname__:
            raise InvalidInputError(
                f"{where}: {component.__name__} is a lambda or a local function, and code cannot be sent to "
                "the server; define it at module level in a package the server imports, register it there "
                "(twinkle.registry.register(<kind>, fn)) and pass its name"
            )
        return component.__name__, {}
    return type(component).__name__, _constructor_kwargs(component, where)


def merged_spec(component: Any, kwargs: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """:func:`component_spec` plus call kwargs; an instance with extra kwargs is an error, as in-process."""
    name, built = component_spec(component, where)
    if built and kwargs:
        raise ConfigurationError(f"{where}: {name} is already an instance; arguments {sorted(kwargs)} would be ignored")
    return name, {**built, **kwargs}


def _constructor_kwargs(component: Any, where: str) -> dict[str, Any]:
    cls = type(component)
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{where}: cannot read how {cls.__name__} is constructed: {exc}") from exc
    kwargs = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise InvalidInputError(
                f"{where}: a {cls.__name__} instance cannot be rebuilt on the server (its constructor takes "
                f"*{parameter.name}); pass its name and arguments instead: ('{cls.__name__}', ...)"
            )
        if not hasattr(component, parameter.name):
            raise InvalidInputError(
                f"{where}: a {cls.__name__} instance cannot be rebuilt on the server: constructor argument "
                f"{parameter.name!r} is not kept as an attribute; pass the name and arguments instead: "
                f"('{cls.__name__}', {parameter.name}=...)"
            )
        value = getattr(component, parameter.name)
        if callable(value):
            raise InvalidInputError(
                f"{where}: {cls.__name__}.{parameter.name} is {value!r}, and code cannot be sent to the server"
            )
        kwargs[parameter.name] = value
    return kwargs
