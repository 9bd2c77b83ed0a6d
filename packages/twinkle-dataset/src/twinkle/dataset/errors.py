"""Errors about dataset rows, raised after a whole pass so one run shows every bad row at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twinkle.errors import InvalidInputError

#: How many bad rows an error message or warning spells out.
MAX_REPORTED_ROWS = 10


class DataProcessingError(InvalidInputError):
    """Some rows could not be processed; ``bad_rows`` holds ``(row index, reason)`` for the first of them.

    Raised by ``Dataset.map``/``encode`` with ``strict=True`` instead of
    dropping rows silently; ``num_bad`` counts all of them.
    """

    def __init__(self, message: str, bad_rows: Sequence[tuple[int, str]] = (), num_bad: int = 0) -> None:
        super().__init__(message)
        self.bad_rows = list(bad_rows)
        self.num_bad = num_bad

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the row details when the error is pickled across processes (num_proc, remote workers).
        return type(self), (str(self), self.bad_rows, self.num_bad)

    @classmethod
    def from_rows(
        cls, step: str, bad_rows: Sequence[tuple[int, str]], num_bad: int, num_rows: int
    ) -> DataProcessingError:
        """The error for ``num_bad`` of ``num_rows`` rows failing ``step``; ``bad_rows`` are the first ones."""
        return cls(
            f"{step}: {num_bad} of {num_rows} rows are invalid{_first_shown(bad_rows, num_bad)}:\n"
            + format_bad_rows(bad_rows)
            + "\nFix these rows, or pass strict=False to drop them.",
            bad_rows,
            num_bad,
        )


def format_bad_rows(bad_rows: Sequence[tuple[int, str]]) -> str:
    """One indented ``row i: reason`` line per bad row (indices count rows of the input to the step)."""
    return "\n".join(f"  row {index}: {reason}" for index, reason in bad_rows)


def _first_shown(bad_rows: Sequence[tuple[int, str]], num_bad: int) -> str:
    return f" (first {len(bad_rows)} shown)" if num_bad > len(bad_rows) else ""
