"""What to do with an encoded sequence longer than ``max_length``.

``'left'`` keeps the end of the sequence (the latest turns, where the answer
usually is), ``'right'`` keeps the beginning, ``'delete'`` drops the row and
``'raise'`` refuses it. Truncation can cut away every labelled token of a
training sequence; such a feature is still returned (its loss is simply zero)
because whether that is acceptable depends on the data, not on the template.
"""

from __future__ import annotations

from typing import Literal, get_args

from twinkle.errors import ConfigurationError
from twinkle.template.errors import SequenceTooLongError

TruncationStrategy = Literal["raise", "left", "right", "delete"]
TRUNCATION_STRATEGIES: tuple[str, ...] = get_args(TruncationStrategy)


def check_truncation_args(max_length: int | None, strategy: str) -> None:
    """Reject a bad ``max_length``/``truncation_strategy`` when the Template is built, not on the first long row."""
    if strategy not in TRUNCATION_STRATEGIES:
        raise ConfigurationError(f"truncation_strategy must be one of {TRUNCATION_STRATEGIES}, got {strategy!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ConfigurationError(f"max_length must be a positive int or None, got {max_length!r}")


def truncate(
    input_ids: list[int],
    labels: list[int],
    max_length: int | None,
    strategy: TruncationStrategy,
    where: str,
) -> tuple[list[int], list[int]] | None:
    """Apply ``strategy`` to ids and labels together; ``None`` means the row is deleted.

    ``where`` names the sequence in the error (``'trajectory'`` or ``'trajectory.rejected_messages'``).
    """
    length = len(input_ids)
    if max_length is None or length <= max_length:
        return input_ids, labels
    if strategy == "raise":
        raise SequenceTooLongError(
            f"{where} encodes to {length} tokens, more than max_length={max_length}; raise max_length or pass "
            "truncation_strategy='left', 'right' or 'delete'"
        )
    if strategy == "delete":
        return None
    if strategy == "left":
        return input_ids[-max_length:], labels[-max_length:]
    return input_ids[:max_length], labels[:max_length]
