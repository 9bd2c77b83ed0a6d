"""``@remote_class``: the seam that lets one component class run locally or remotely.

A decorated class accepts two extra constructor keywords, ``remote_group`` (a
device group name) and ``device_mesh``. The active runtime decides what
construction means: the local runtime builds the object here and records where
it was placed; a remote runtime may return a proxy exposing the same methods.
Either way user code is identical.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

C = TypeVar("C", bound=type)


def remote_class(cls: C) -> C:
    """Make ``cls`` placeable on a device group (see module docstring)."""
    original_new = cls.__new__
    original_init = cls.__init__  # type: ignore[misc]  # the class's own __init__, read before it is replaced

    def __new__(klass: type, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        from twinkle.infra import get_runtime

        proxy = get_runtime().instantiate(klass, args, kwargs, remote_group)
        if proxy is not None:
            return proxy
        if original_new is object.__new__:  # type: ignore[comparison-overlap]  # no __new__ of its own
            return object.__new__(klass)
        return original_new(klass, *args, **kwargs)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, remote_group: str | None = None, **kwargs: Any) -> None:
        from twinkle.infra import get_runtime

        if "remote_group" not in self.__dict__:  # a decorated subclass already placed it
            self.remote_group = get_runtime().place(self, remote_group, kwargs.get("device_mesh"))
        original_init(self, *args, **kwargs)

    cls.__new__ = __new__  # type: ignore[assignment]
    cls.__init__ = __init__  # type: ignore[misc]
    return cls
