"""``CalculatorEnv``: arithmetic the model answers by calling a ``calculator`` tool, then stating the result."""

from __future__ import annotations

import random
import re
from typing import Any

from twinkle.data_format import Message, Tool
from twinkle.env.arithmetic import ExpressionError, evaluate, format_number
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Env, EnvStep
from twinkle.registry import register

CALCULATOR_TOOL: Tool = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37 * (12 + 5)"}},
            "required": ["expression"],
        },
    },
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@register("env")
class CalculatorEnv(Env):
    """ "What is 417 * 38?": too hard to compute in the head of a small model, easy with the tool.

    Each episode draws ``num_operands`` integers in ``[low, high]`` joined by
    ``operators``. A turn with tool calls gets each call's result (or an error)
    back as a ``tool`` message; the first turn without tool calls is the answer,
    and its last number is compared with the exact value: reward 1.0 if equal,
    else 0.0. ``info`` counts the tool calls and says whether the calculator
    was used correctly, for the tool-use rate.
    """

    tools = (CALCULATOR_TOOL,)

    def __init__(self, low: int = 100, high: int = 999, num_operands: int = 2, operators: str = "+-*") -> None:
        if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= high):
            raise InvalidInputError(f"need integers 0 <= low <= high, got low={low!r}, high={high!r}")
        if not isinstance(num_operands, int) or num_operands < 2:
            raise InvalidInputError(f"num_operands must be an int >= 2, got {num_operands!r}")
        if not operators or set(operators) - set("+-*"):
            raise InvalidInputError(f"operators must be a non-empty string of '+', '-', '*', got {operators!r}")
        self.low, self.high, self.num_operands, self.operators = low, high, num_operands, operators
        self.expression = ""
        self.answer = ""
        self.tool_calls = 0

    def reset(self, seed: int) -> list[Message]:
        rng = random.Random(seed)
        parts = [str(rng.randint(self.low, self.high))]
        for _ in range(self.num_operands - 1):
            parts += [rng.choice(self.operators), str(rng.randint(self.low, self.high))]
        self.expression = " ".join(parts)
        self.answer = format_number(evaluate(self.expression))
        self.tool_calls = 0
        return [{"role": "user", "content": f"What is {self.expression}?"}]

    def step(self, action: Message) -> EnvStep:
        calls = action.get("tool_calls") or []
        if calls:
            self.tool_calls += len(calls)
            return EnvStep(messages=[self._run(call) for call in calls], info=self._info(None))
        numbers = _NUMBER.findall(action.get("content") or "")
        correct = bool(numbers) and numbers[-1] == self.answer
        return EnvStep(reward=float(correct), done=True, info=self._info(correct))

    def _run(self, call: Any) -> Message:
        function = call.get("function", call)
        if function.get("name") != "calculator":
            return {"role": "tool", "content": f"error: unknown tool {function.get('name')!r}; use calculator"}
        try:
            return {"role": "tool", "content": format_number(evaluate(function["arguments"].get("expression")))}
        except ExpressionError as exc:
            return {"role": "tool", "content": f"error: {exc}"}

    def _info(self, correct: bool | None) -> dict[str, Any]:
        return {"tool_calls": self.tool_calls, "correct": correct, "answer": self.answer}
