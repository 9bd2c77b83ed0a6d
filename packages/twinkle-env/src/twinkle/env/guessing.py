"""``GuessNumberEnv``: a multi-turn guessing game, with "higher" / "lower" feedback after every guess."""

from __future__ import annotations

import random
import re

from twinkle.data_format import Message
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Env, EnvStep
from twinkle.registry import register

_INTEGER = re.compile(r"-?\d+")


@register("env")
class GuessNumberEnv(Env):
    """Find a secret integer in ``[low, high]`` in at most ``max_guesses`` guesses.

    Each turn's last integer is the guess; the user answers ``Higher.``,
    ``Lower.`` or, for a turn without a number, asks for one (it still counts
    as a guess). Finding it gives reward ``1 - (guesses - 1) / max_guesses``,
    so fewer guesses score more (binary search is the optimum); running out
    gives 0.
    """

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 8) -> None:
        if not (isinstance(low, int) and isinstance(high, int) and low <= high):
            raise InvalidInputError(f"need integers low <= high, got low={low!r}, high={high!r}")
        if not isinstance(max_guesses, int) or max_guesses < 1:
            raise InvalidInputError(f"max_guesses must be a positive int, got {max_guesses!r}")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.secret = low
        self.guesses = 0

    def reset(self, seed: int) -> list[Message]:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.guesses = 0
        prompt = (
            f"I am thinking of an integer between {self.low} and {self.high}. Guess it: answer with one number, "
            f"and I will say higher or lower. You have {self.max_guesses} guesses."
        )
        return [{"role": "user", "content": prompt}]

    def step(self, action: Message) -> EnvStep:
        self.guesses += 1
        numbers = _INTEGER.findall(action.get("content") or "")
        guess = int(numbers[-1]) if numbers else None
        info = {"guesses": self.guesses, "secret": self.secret}
        if guess == self.secret:
            return EnvStep(reward=1.0 - (self.guesses - 1) / self.max_guesses, done=True, info=info)
        if self.guesses >= self.max_guesses:
            return EnvStep(done=True, info=info)
        feedback = "Answer with one number." if guess is None else "Higher." if guess < self.secret else "Lower."
        return EnvStep(messages=[{"role": "user", "content": feedback}], info=info)
