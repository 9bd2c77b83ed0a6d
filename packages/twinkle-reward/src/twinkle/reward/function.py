"""Plain Python functions as rewards: :class:`FunctionReward` and the :func:`reward` decorator."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.registry import register
from twinkle.reward.base import CompletionReward

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@register("reward")
class FunctionReward(CompletionReward):
    """Wraps ``fn(completion, user_data) -> float`` or ``fn(trajectory) -> float``.

    Which one is read from ``fn``'s signature: exactly one positional parameter
    means the whole trajectory (for rewards that look at the prompt, tools or
    token counts); two or more, or ``*args``, mean ``(completion, user_data)``.
    Make a function's own options keyword-only (``def f(trajectory, *, scale=2.0)``)
    so they do not count. Every result is checked to be a finite number, like any
    other reward's.
    """

    def __init__(self, fn: Callable[..., float]) -> None:
        if not callable(fn):
            raise InvalidInputError(f"FunctionReward needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.takes_trajectory = _takes_trajectory(fn)

    def score_trajectory(self, trajectory: Mapping[str, Any]) -> float:
        return self.fn(trajectory) if self.takes_trajectory else super().score_trajectory(trajectory)

    def score(self, completion: str, user_data: Mapping[str, Any]) -> float:
        return self.fn(completion, user_data)

    def __repr__(self) -> str:
        return f"FunctionReward({getattr(self.fn, '__qualname__', self.fn)!r})"


def reward(fn: Callable[..., float]) -> FunctionReward:
    """Decorator: ``@reward`` turns a scoring function into a :class:`FunctionReward` over batches.

    >>> @reward
    ... def short(completion, user_data):
    ...     return float(len(completion) < 10)
    >>> short([{"completion": "yes"}, {"completion": "a long ramble"}])
    [1.0, 0.0]
    """
    return FunctionReward(fn)


def _takes_trajectory(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"cannot read the signature of reward function {fn!r}: {exc}") from exc
    positional = [p for p in parameters if p.kind in _POSITIONAL]
    if not positional and all(p.kind is not inspect.Parameter.VAR_POSITIONAL for p in parameters):
        raise InvalidInputError(
            f"reward function {getattr(fn, '__qualname__', fn)!r} must take (completion, user_data) or (trajectory)"
        )
    return len(positional) == 1
