"""``builtin://preference-mini``: DPO pairs with one simple, consistent preference.

Every prompt asks for ``a op b``. The chosen reply is polite and correct; the
rejected reply is wrong, rude, or both. Because the rule never changes, a tiny
model can visibly learn it, which makes DPO runs and reward margins testable on
a CPU. Rows are ``{"prompt", "chosen", "rejected"}``; train and test never share
a calculation, let alone a prompt.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable
from pathlib import Path

from twinkle.hub.data.jsonl import write_jsonl

TRAIN_SIZE = 400
TEST_SIZE = 100
SEED = 11

OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
PROMPTS = (
    "What is {a} {op} {b}?",
    "Please calculate {a} {op} {b}.",
    "Can you tell me what {a} {op} {b} equals?",
    "Quick question: how much is {a} {op} {b}?",
)
POLITE_OPENERS = ("Sure!", "Of course.", "Happy to help:", "Good question!")
RUDE_OPENERS = ("Ugh, that's trivial.", "Can't you do this yourself?", "Whatever.", "Seriously? Fine.")
_WRONG_BY = (-3, -2, -1, 1, 2, 3)


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    if op == "*":
        return rng.randint(2, 12), rng.randint(2, 12)
    a = rng.randint(1, 30)
    return (a, rng.randint(1, a)) if op == "-" else (a, rng.randint(1, 30))


def _wrong(rng: random.Random, correct: int) -> int:
    return correct + rng.choice([delta for delta in _WRONG_BY if correct + delta >= 0])


def _pair(rng: random.Random, a: int, op: str, b: int) -> dict[str, str]:
    correct = OPERATIONS[op](a, b)
    rude, wrong = rng.choice(((True, False), (False, True), (True, True)))
    rejected_result = _wrong(rng, correct) if wrong else correct
    rejected_opener = rng.choice(RUDE_OPENERS if rude else POLITE_OPENERS)
    return {
        "prompt": rng.choice(PROMPTS).format(a=a, op=op, b=b),
        "chosen": f"{rng.choice(POLITE_OPENERS)} {a} {op} {b} = {correct}.",
        "rejected": f"{rejected_opener} {a} {op} {b} = {rejected_result}.",
    }


def preference_mini_splits(seed: int = SEED) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Return ``(train, test)`` rows; each calculation ``a op b`` is used at most once."""
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < TRAIN_SIZE + TEST_SIZE:
        op = rng.choice(tuple(OPERATIONS))
        a, b = _operands(rng, op)
        if (a, op, b) not in seen:
            seen.add((a, op, b))
            rows.append(_pair(rng, a, op, b))
    return rows[:TRAIN_SIZE], rows[TRAIN_SIZE:]


def build(target: Path) -> None:
    """Write ``train.jsonl`` and ``test.jsonl``."""
    train, test = preference_mini_splits()
    write_jsonl(target / "train.jsonl", train)
    write_jsonl(target / "test.jsonl", test)
