"""Plain functions as preprocessors, and :func:`as_preprocessor`, the one way to resolve a preprocessor spec."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twinkle.data_format import Trajectory
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.registry import build, register

RowFunction = Callable[[Mapping[str, Any]], "Trajectory | None"]


@register("preprocessor")
class FunctionPreprocessor(Preprocessor):
    """Wraps ``fn(row) -> Trajectory | None`` so a lambda can go wherever a Preprocessor does."""

    def __init__(self, fn: RowFunction) -> None:
        if not callable(fn):
            raise InvalidInputError(f"FunctionPreprocessor needs a callable, got {type(fn).__name__}")
        self.fn = fn

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory | None:
        return self.fn(row)

    def __repr__(self) -> str:
        return f"FunctionPreprocessor({getattr(self.fn, '__qualname__', self.fn)!r})"


def as_preprocessor(spec: Any, /, **kwargs: Any) -> Preprocessor:
    """Resolve anything a user may hand to ``Dataset.map`` to a :class:`Preprocessor`.

    ``spec`` is a Preprocessor instance, a class or registered name (built with
    ``kwargs``), an import path ``"pkg.mod:Name"``, or a plain callable on rows.
    """
    component = build("preprocessor", spec, **kwargs)
    if isinstance(component, Preprocessor):
        return component
    if callable(component):
        return FunctionPreprocessor(component)
    raise InvalidInputError(
        f"expected a Preprocessor, a preprocessor name or a function on rows, got {type(component).__name__}"
    )
