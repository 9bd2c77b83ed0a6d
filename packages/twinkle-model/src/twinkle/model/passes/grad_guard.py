"""Gradients put back as they were when a request fails after its forward (a non-finite loss, say)."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import torch


class GradGuard:
    """Restores parameters' gradients if the guarded block raises (no half-applied step)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = params
        self.saved: list[torch.Tensor | None] = []

    def __enter__(self) -> GradGuard:
        return self.save()

    def save(self) -> GradGuard:
        """Remember the current gradients (copies: later backwards accumulate in place)."""
        self.saved = [None if p.grad is None else p.grad.clone() for p in self.params]
        return self

    def restore(self) -> None:
        """Put back the gradients saved on entry."""
        for param, grad in zip(self.params, self.saved, strict=True):
            param.grad = grad

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.restore()
        self.saved = []
