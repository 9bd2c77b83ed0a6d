"""Finding a completion's final answer and comparing answers.

Extractors return the raw answer text (or ``None``); comparison is numeric when
both sides read as numbers and a normalised string match otherwise, so ``18``,
``18.0``, ``$18`` and ``\\boxed{18}`` agree while ``x+1`` and ``1+x`` do not
(no symbolic algebra: that would need sympy, and this package stays dependency-free).
"""

from __future__ import annotations

import math
import re

# A decimal number with optional thousands separators: 18, 1,234, 3.5, .5
NUMBER_PATTERN = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# An optional minus on either side of an optional dollar sign (callers map the Unicode minus to "-" first).
_SIGNED_NUMBER = re.compile(rf"(?<![\w.])(?P<sign>-?)\$?(?P<sign2>-?)(?P<number>{NUMBER_PATTERN})(?!\d)")
_FRACTION = re.compile(rf"(?P<sign>-?)(?P<num>{NUMBER_PATTERN})/(?P<den>{NUMBER_PATTERN})")
_LATEX_FRACTION = re.compile(r"(?P<sign>-?)\\frac\{(?P<num>[^{}]+)\}\{(?P<den>[^{}]+)\}")
_STATED = re.compile(r"answer\s*(?:is|:)\s*:?\s*(?P<answer>[^\n]+?)\s*(?:\.(?:\s|$)|\n|$)", re.IGNORECASE)
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
# LaTeX spacing and sizing that never changes an answer's value.
_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\^\{?\\circ\}?|\*\*|\s+|\$")
_PERCENT = re.compile(r"\\?%$")
_TOLERANCE = 1e-6


def hash_answer(text: str) -> str | None:
    """The rest of the line after the last ``####`` (GSM8K's answer marker)."""
    _, marker, rest = text.rpartition("####")
    answer = rest.split("\n", 1)[0].strip()
    return answer if marker and answer else None


def boxed_answer(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0 or text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None
    close = _closing_brace(text, brace)
    answer = text[brace + 1 : close].strip() if close is not None else ""
    return answer or None


def stated_answer(text: str) -> str | None:
    """``X`` from the last "answer is X" or "answer: X" (up to the end of that sentence or line)."""
    matches = list(_STATED.finditer(text))
    return matches[-1].group("answer") if matches else None


def first_number(text: str) -> float | None:
    """The first number in ``text`` (``'$1,234.50 in total'`` → 1234.5), or ``None``."""
    match = _SIGNED_NUMBER.search(text.replace("−", "-"))
    if match is None:
        return None
    value = float(match.group("number").replace(",", ""))
    return -value if match.group("sign") or match.group("sign2") else value


def parse_number(text: str) -> float | None:
    """``text`` as a number when it is only a number: ``-3``, ``1,000``, ``2.5``, ``3/4``, ``\\frac{3}{4}``, ``50%``."""
    cleaned = _PERCENT.sub("", _clean(text))
    for pattern in (_SIGNED_NUMBER, _FRACTION, _LATEX_FRACTION):
        match = pattern.fullmatch(cleaned)
        if match is not None:
            return _value(match)
    return None


def normalize_answer(text: str) -> str:
    """A canonical string for non-numeric answers: LaTeX spacing, ``$``, ``\\text{}`` and case removed."""
    return _clean(text).lower()


def numbers_equal(predicted: float, reference: float) -> bool:
    """Equal up to float rounding (``18.0 == 18``; ``0.3333333`` ≈ ``1/3`` is *not* accepted)."""
    return math.isclose(predicted, reference, rel_tol=_TOLERANCE, abs_tol=_TOLERANCE)


def same_answer(predicted: str | None, reference: str) -> bool:
    """Numeric equality when both read as numbers, else equality of :func:`normalize_answer`."""
    if predicted is None:
        return False
    predicted_number, reference_number = parse_number(predicted), parse_number(reference)
    if predicted_number is not None and reference_number is not None:
        return numbers_equal(predicted_number, reference_number)
    normalized = normalize_answer(predicted)
    return bool(normalized) and normalized == normalize_answer(reference)


def _clean(text: str) -> str:
    """Drop what never changes an answer (LaTeX spacing and sizing, ``$``, ``\\text{}``, outer braces)."""
    text = _TEXT_COMMAND.sub(r"\1", text.replace("−", "-"))
    text = _NOISE.sub("", text).rstrip(".").replace("{,}", ",")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    while text.startswith("{") and _closing_brace(text, 0) == len(text) - 1:
        text = text[1:-1]
    return text


def _closing_brace(text: str, open_index: int) -> int | None:
    """The index of the ``}`` matching the ``{`` at ``open_index``, or ``None`` when unbalanced."""
    depth = 0
    for index in range(open_index, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return index
    return None


def _value(match: re.Match[str]) -> float | None:
    groups = match.groupdict()
    negative = bool(groups.get("sign") or groups.get("sign2"))
    if "number" in groups:
        value = float(groups["number"].replace(",", ""))
    else:
        numerator, denominator = (parse_number(groups[key]) for key in ("num", "den"))
        if numerator is None or not denominator:
            return None
        value = numerator / denominator
    return -value if negative else value
