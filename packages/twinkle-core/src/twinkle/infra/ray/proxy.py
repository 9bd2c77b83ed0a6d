"""The driver-side face of a remote component: :class:`ActorProxy` and the :class:`LazyResult` of a call.

Both are plain Python (no Ray import), so code that only needs to recognise a
proxy — e.g. the checkpoint engine choosing its transfer path — works without
Ray installed. The work is done by a :class:`Backend` (``twinkle.infra.ray.actors``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

_MISSING = object()


class Backend(Protocol):
    """What a proxy delegates to: the component's class and its workers."""

    cls: type
    group: str  # the name of the device group its workers are placed on

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def read(self, name: str) -> Any: ...

    def put(self, fn: Callable[[Any], Any], what: str) -> Any: ...

    def apply(self, fn: Callable[[Any, Any], Any], value: Any, what: str) -> None: ...

    @property
    def size(self) -> int: ...

    def start(
        self, fn: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], what: str
    ) -> Callable[[], list[Any]]: ...

    def describe(self) -> str: ...


class ActorProxy:
    """Stands in for a component whose workers are Ray actors; the driver calls the same methods.

    Methods of the component's class become remote calls (dispatched and
    collected by :mod:`twinkle.infra.ray.dispatch`); any other attribute —
    a property, or one set in ``__init__`` — is read from the first worker.
    ``for item in proxy`` iterates the remote component (e.g. a DataLoader).
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_backend":  # protocols probed by Python; unset while unpickling
            raise AttributeError(name)
        attr = inspect.getattr_static(self._backend.cls, name, _MISSING)
        if isinstance(attr, (staticmethod, classmethod)) or (callable(attr) and not isinstance(attr, type)):
            return _RemoteMethod(self._backend, name)
        return self._backend.read(name)

    def __iter__(self) -> Iterator[Any]:
        self._require("__iter__", "is not iterable")
        _resolved(self._backend.call("__iter__", (), {}))
        while (item := _resolved(self._backend.call("__next__", (), {}))) is not END_OF_ITERATION:
            yield item

    def __len__(self) -> int:
        self._require("__len__", "has no len()")
        return int(_resolved(self._backend.call("__len__", (), {})))

    def _require(self, method: str, problem: str) -> None:
        if not hasattr(self._backend.cls, method):  # as for a local object (list() probes __len__)
            raise TypeError(f"{self._backend.cls.__name__} {problem}")

    def __bool__(self) -> bool:  # without this, ``if proxy:`` would ask the remote __len__
        return True

    def __repr__(self) -> str:
        return f"<ActorProxy {self._backend.describe()}>"


class _EndOfIteration:
    """Returned by a worker's ``__next__`` when its iterator is exhausted (StopIteration does not cross Ray)."""

    def __reduce__(self) -> str:
        return "END_OF_ITERATION"  # unpickles to the module's singleton, so ``is`` works after transport


END_OF_ITERATION = _EndOfIteration()


class _RemoteMethod:
    """A bound remote method: ``proxy.forward_backward(...)``."""

    def __init__(self, backend: Backend, name: str) -> None:
        self._backend = backend
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._backend.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<remote method {self.__name__} of {self._backend.describe()}>"


class LazyResult:
    """The future result of a call made with ``lazy_collect=True``: resolved on first use, or by :meth:`result`.

    Attribute access, indexing, iteration, ``len``, ``str``/``format`` and
    comparisons resolve it and act on the real value; ``isinstance`` checks do
    not, so call :meth:`result` when the real object is needed.
    """

    def __init__(self, resolve: Callable[[], Any], description: str) -> None:
        self._resolve = resolve
        self._description = description
        self._done = False
        self._value: Any = None
        self._error: Exception | None = None

    @property
    def resolved(self) -> bool:
        """Whether :meth:`result` has been asked for (its value or exception is then kept)."""
        return self._done

    def result(self) -> Any:
        """Wait for the call and return its collected value; raise the worker's exception (every time)."""
        if not self._done:
            self._done = True
            try:
                self._value = self._resolve()
            except Exception as error:
                self._error = error
        if self._error is not None:
            raise self._error
        return self._value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.result(), name)

    def __getitem__(self, key: Any) -> Any:
        return self.result()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.result())

    def __len__(self) -> int:
        return len(self.result())

    def __bool__(self) -> bool:
        return bool(self.result())

    def __eq__(self, other: object) -> bool:
        return bool(self.result() == _resolved(other))

    __hash__ = None  # type: ignore[assignment]  # equality follows a value that may change type

    def __float__(self) -> float:
        return float(self.result())

    def __str__(self) -> str:
        return str(self.result())

    def __format__(self, spec: str) -> str:
        return format(self.result(), spec)

    def __repr__(self) -> str:
        state = "pending" if not self._done else repr(self._error or self._value)
        return f"<LazyResult of {self._description}: {state}>"


def _resolved(value: Any) -> Any:
    return value.result() if isinstance(value, LazyResult) else value
