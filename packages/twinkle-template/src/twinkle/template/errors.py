"""Errors raised while turning trajectories into tokens."""

from __future__ import annotations

from twinkle.errors import InvalidInputError


class TemplateError(InvalidInputError):
    """A chat template is missing, fails to render, or cannot locate the assistant turns."""


class SequenceTooLongError(TemplateError):
    """An encoded sequence exceeds ``max_length`` under ``truncation_strategy='raise'``."""
