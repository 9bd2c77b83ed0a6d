"""SeqGate: a model's requests are released in seq_id order whatever order they arrive in."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from twinkle.errors import InvalidInputError
from twinkle.server.tinker.ordering import SeqGate


def recorder() -> tuple[list[str], Callable[[str], Callable[[], None]]]:
    events: list[str] = []

    def make(label: str):
        return lambda: events.append(label)

    return events, make


def test_out_of_order_arrivals_are_released_in_order():
    gate, (events, make) = SeqGate(), recorder()
    gate.open("m")
    gate.submit("m", 2, make("release 2"), make("cancel 2"))
    gate.submit("m", 3, make("release 3"), make("cancel 3"))
    assert events == [] and gate.waiting("m") == [2, 3]
    gate.submit("m", 1, make("release 1"), make("cancel 1"))  # the SDK sends a chunked call's first chunk last
    assert events == ["release 1", "release 2", "release 3"]
    gate.submit("m", 4, make("release 4"), make("cancel 4"))
    assert events[-1] == "release 4" and gate.waiting("m") == []


def test_models_are_ordered_independently_and_seq_zero_is_unordered():
    gate, (events, make) = SeqGate(), recorder()
    gate.open("a")
    gate.open("b", next_seq_id=5)
    gate.submit("a", 2, make("a2"), make("x"))
    gate.submit("b", 5, make("b5"), make("x"))
    gate.submit("a", 0, make("a0"), make("x"))
    assert events == ["b5", "a0"]


def test_a_used_or_duplicate_seq_id_and_an_unknown_model_are_refused():
    gate, (_, make) = SeqGate(), recorder()
    gate.open("m")
    gate.submit("m", 1, make("1"), make("x"))
    with pytest.raises(InvalidInputError, match=r"seq_id 1 .* already used"):
        gate.submit("m", 1, make("again"), make("x"))
    gate.submit("m", 3, make("3"), make("x"))
    with pytest.raises(InvalidInputError, match="already waiting"):
        gate.submit("m", 3, make("3 again"), make("x"))
    with pytest.raises(InvalidInputError, match="not loaded"):
        gate.submit("other", 1, make("1"), make("x"))


def test_closing_a_model_cancels_what_it_held():
    gate, (events, make) = SeqGate(), recorder()
    gate.open("m")
    gate.submit("m", 3, make("release 3"), make("cancel 3"))
    gate.close("m")
    assert events == ["cancel 3"]
    with pytest.raises(InvalidInputError, match="not loaded"):
        gate.submit("m", 1, make("1"), make("x"))
