"""Arithmetic on untrusted text: numbers, ``+ - * / // % **`` and parentheses, nothing else (no ``eval``)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


class ExpressionError(ValueError):
    """The expression is not plain arithmetic, or its value is undefined or too large."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; :class:`ExpressionError` says what is wrong with it."""
    if not isinstance(expression, str):
        raise ExpressionError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/").replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ExpressionError(f"cannot parse {expression!r} as arithmetic") from None
    return _value(tree.body)


def _value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = _value(node.operand)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ExpressionError(f"exponents must be integers up to {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ExpressionError("division by zero")
            result = Fraction(left ** int(right))
        elif type(node.op) in _BINARY:
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
                raise ExpressionError("division by zero")
            result = Fraction(_BINARY[type(node.op)](left, right))
        else:
            raise ExpressionError(f"operator {type(node.op).__name__} is not supported")
        if abs(result) > MAX_MAGNITUDE:
            raise ExpressionError("the result is too large")
        return result
    raise ExpressionError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def format_number(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal rounded to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
