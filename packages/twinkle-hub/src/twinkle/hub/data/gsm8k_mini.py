"""``builtin://gsm8k-mini``: GSM8K-format word problems small enough for a tiny model to learn.

Rows are ``{"question", "answer"}`` where the answer is one line per reasoning
step, each holding one ``a op b = c`` equation, then ``#### <integer>``, exactly
the shape GSM8K rewards parse. Problems are one or two steps with small integers,
so reinforcement learning on a CPU can move the accuracy within minutes.

Every problem is drawn from a seeded ``random.Random`` and computed, not typed,
so answers are correct by construction; train and test questions never repeat.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from twinkle.hub.data.jsonl import write_jsonl

TRAIN_SIZE = 2000
TEST_SIZE = 200
SEED = 8

_PEOPLE = (
    ("Anna", "She"),
    ("Ben", "He"),
    ("Chen", "He"),
    ("Dina", "She"),
    ("Emma", "She"),
    ("Farid", "He"),
    ("Grace", "She"),
    ("Hiro", "He"),
    ("Ivy", "She"),
    ("Jack", "He"),
    ("Lena", "She"),
    ("Maya", "She"),
    ("Noah", "He"),
    ("Omar", "He"),
    ("Priya", "She"),
    ("Sam", "He"),
)
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "cards", "books", "stamps", "shells", "candies")
_GOODS = (("notebook", "notebooks"), ("pen", "pens"), ("sandwich", "sandwiches"), ("ticket", "tickets"))
_ACTIVITIES = (("reads", "pages"), ("swims", "laps"), ("bakes", "muffins"), ("writes", "letters"), ("plants", "trees"))
_CROWDS = (("birds", "tree"), ("ducks", "pond"), ("cars", "parking lot"), ("children", "playground"))
_BILLS = (10, 20, 50)


@dataclass(frozen=True)
class Problem:
    """A word problem, its reasoning steps (one equation each) and the final integer answer."""

    question: str
    steps: tuple[str, ...]
    answer: int

    def to_row(self) -> dict[str, str]:
        return {"question": self.question, "answer": "\n".join(self.steps) + f"\n#### {self.answer}"}


def _add(rng: random.Random) -> Problem:
    (name, pronoun), item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    start, more = rng.randint(2, 40), rng.randint(2, 30)
    total = start + more
    return Problem(
        f"{name} has {start} {item}. {pronoun} gets {more} more {item}. How many {item} does {name} have now?",
        (f"{name} has {start} + {more} = {total} {item} now.",),
        total,
    )


def _subtract(rng: random.Random) -> Problem:
    name, item = rng.choice(_PEOPLE)[0], rng.choice(_ITEMS)
    start = rng.randint(10, 60)
    given = rng.randint(1, start - 1)
    left = start - given
    return Problem(
        f"{name} had {start} {item} and gave {given} of them to a friend. How many {item} does {name} have left?",
        (f"{name} has {start} - {given} = {left} {item} left.",),
        left,
    )


def _multiply(rng: random.Random) -> Problem:
    name, item = rng.choice(_PEOPLE)[0], rng.choice(_ITEMS)
    boxes, per_box = rng.randint(2, 9), rng.randint(2, 12)
    total = boxes * per_box
    return Problem(
        f"{name} buys {boxes} boxes of {item}. Each box holds {per_box} {item}. How many {item} does {name} buy?",
        (f"{name} buys {boxes} * {per_box} = {total} {item}.",),
        total,
    )


def _divide(rng: random.Random) -> Problem:
    name, item = rng.choice(_PEOPLE)[0], rng.choice(_ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    total = friends * each
    return Problem(
        f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?",
        (f"Each friend gets {total} / {friends} = {each} {item}.",),
        each,
    )


def _add_packs(rng: random.Random) -> Problem:
    (name, pronoun), item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    start, packs, per_pack = rng.randint(1, 20), rng.randint(2, 6), rng.randint(2, 10)
    bought = packs * per_pack
    total = start + bought
    return Problem(
        f"{name} has {start} {item}. {pronoun} buys {packs} packs with {per_pack} {item} in each pack. "
        f"How many {item} does {name} have now?",
        (f"The packs hold {packs} * {per_pack} = {bought} {item}.", f"{name} has {start} + {bought} = {total} {item}."),
        total,
    )


def _change(rng: random.Random) -> Problem:
    name, (good, goods) = rng.choice(_PEOPLE)[0], rng.choice(_GOODS)
    price, count = rng.randint(2, 9), rng.randint(2, 5)
    cost = price * count
    bill = min(b for b in _BILLS if b > cost)
    change = bill - cost
    return Problem(
        f"A {good} costs ${price}. {name} buys {count} {goods} and pays with a ${bill} bill. "
        f"How much change does {name} get?",
        (f"The {goods} cost {count} * {price} = {cost} dollars.", f"The change is {bill} - {cost} = {change} dollars."),
        change,
    )


def _twice(rng: random.Random) -> Problem:
    name, (verb, unit) = rng.choice(_PEOPLE)[0], rng.choice(_ACTIVITIES)
    monday = rng.randint(3, 30)
    tuesday = monday * 2
    total = monday + tuesday
    return Problem(
        f"{name} {verb} {monday} {unit} on Monday and twice as many {unit} on Tuesday. "
        f"How many {unit} does {name} {verb.removesuffix('s')} in total?",
        (
            f"On Tuesday {name} {verb} {monday} * 2 = {tuesday} {unit}.",
            f"In total that is {monday} + {tuesday} = {total} {unit}.",
        ),
        total,
    )


def _leave_and_arrive(rng: random.Random) -> Problem:
    crowd, place = rng.choice(_CROWDS)
    start = rng.randint(10, 40)
    left, arrived = rng.randint(1, start - 1), rng.randint(1, 20)
    remaining = start - left
    total = remaining + arrived
    return Problem(
        f"There are {start} {crowd} at the {place}. {left} of them leave and then {arrived} more arrive. "
        f"How many {crowd} are at the {place} now?",
        (
            f"After {left} leave, there are {start} - {left} = {remaining} {crowd}.",
            f"After {arrived} arrive, there are {remaining} + {arrived} = {total} {crowd}.",
        ),
        total,
    )


def _bags(rng: random.Random) -> Problem:
    name, item = rng.choice(_PEOPLE)[0], rng.choice(_ITEMS)
    bags, per_bag = rng.randint(2, 8), rng.randint(2, 10)
    total = bags * per_bag
    kept = total - per_bag
    return Problem(
        f"{name} puts {total} {item} equally into {bags} bags and gives one bag away. "
        f"How many {item} does {name} have left?",
        (
            f"Each bag holds {total} / {bags} = {per_bag} {item}.",
            f"{name} has {total} - {per_bag} = {kept} {item} left.",
        ),
        kept,
    )


_TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    _add,
    _subtract,
    _multiply,
    _divide,
    _add_packs,
    _change,
    _twice,
    _leave_and_arrive,
    _bags,
)


def gsm8k_mini_splits(seed: int = SEED) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Return ``(train, test)`` rows; a question never appears twice, so the splits are disjoint."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < TRAIN_SIZE + TEST_SIZE:
        problem = rng.choice(_TEMPLATES)(rng)
        if problem.question not in seen:
            seen.add(problem.question)
            rows.append(problem.to_row())
    return rows[:TRAIN_SIZE], rows[TRAIN_SIZE:]


def build(target: Path) -> None:
    """Write ``train.jsonl`` and ``test.jsonl``."""
    train, test = gsm8k_mini_splits()
    write_jsonl(target / "train.jsonl", train)
    write_jsonl(target / "test.jsonl", test)
