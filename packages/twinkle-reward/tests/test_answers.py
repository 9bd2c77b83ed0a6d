"""Answer extraction and comparison helpers, on the strings models actually write."""

from __future__ import annotations

import pytest

from twinkle.reward import (
    boxed_answer,
    final_answer,
    first_number,
    hash_answer,
    normalize_answer,
    parse_number,
    same_answer,
    stated_answer,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", 18.0),
        ("18.0", 18.0),
        ("$1,234.50.", 1234.5),
        ("-5", -5.0),
        ("−7", -7.0),  # Unicode minus, common in model output
        ("$-3", -3.0),
        ("-$3", -3.0),
        (".5", 0.5),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{1}{2}", 0.5),
        ("{5}", 5.0),
        ("50%", 50.0),
        ("50\\%", 50.0),
        ("1{,}000", 1000.0),
        (" 42 ", 42.0),
    ],
)
def test_parse_number_reads_whole_numbers(text, expected):
    assert parse_number(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["x+1", "18 apples", "1/0", "", "(1, 2)", "\\frac{a}{b}", "1.2.3"])
def test_parse_number_rejects_non_numbers(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18 dollars", 18.0),
        ("**$1,080** per week", 1080.0),
        ("She has -4 left, then 6", -4.0),
        ("Q3 revenue grew by 12", 12.0),  # digits inside a word are not a number
        ("2.5 hours", 2.5),
        ("no digits here", None),
    ],
)
def test_first_number(text, expected):
    assert first_number(text) == expected


def test_hash_answer_takes_the_line_after_the_last_marker():
    assert hash_answer("48/2 = 24\n#### 24\nextra words") == "24"
    assert hash_answer("#### 1\nthen I changed my mind\n####  72 ") == "72"
    assert hash_answer("no marker at all") is None
    assert hash_answer("ends with a bare marker ####") is None


def test_boxed_answer_balances_nested_braces():
    assert boxed_answer("so x = \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert boxed_answer("\\boxed{1} wait, \\boxed{2}") == "2"
    assert boxed_answer("\\fbox{7}") == "7"
    assert boxed_answer("\\boxed {3}") == "3"
    assert boxed_answer("unclosed \\boxed{\\frac{1}{2}") is None
    assert boxed_answer("\\boxed{}") is None
    assert boxed_answer("\\boxedx{3}") is None


def test_stated_answer_takes_the_last_statement():
    assert stated_answer("So the answer is 3.5. Let me double check.") == "3.5"
    assert stated_answer("The answer is 4.\nActually, the answer is 5.") == "5"
    assert stated_answer("Final Answer: $\\frac{2}{3}$") == "$\\frac{2}{3}$"
    assert stated_answer("I think it is 12") is None


def test_final_answer_prefers_boxed_then_hash_then_statement():
    assert final_answer("The answer is 3. \\boxed{4}\n#### 5") == "4"
    assert final_answer("The answer is 3.\n#### 5") == "5"
    assert final_answer("The answer is 3.") == "3"
    assert final_answer("just words") is None


def test_normalize_answer_drops_presentation_only():
    assert normalize_answer("$\\left( 1, 2 \\right)$") == "(1,2)"
    assert normalize_answer("\\text{Monday}.") == "monday"
    assert normalize_answer("90^\\circ") == "90"
    assert normalize_answer("\\dfrac{x}{2}") == "\\frac{x}{2}"


@pytest.mark.parametrize(
    ("predicted", "reference", "expected"),
    [
        ("18.0", "18", True),
        ("1/2", "0.5", True),
        ("\\frac{1}{2}", "1/2", True),
        ("1,000", "1000", True),
        ("0.333", "1/3", False),
        ("\\text{(B)}", "(b)", True),
        ("x+1", "1+x", False),  # no symbolic algebra, on purpose
        ("", "", False),  # an empty answer never matches
        (None, "18", False),
    ],
)
def test_same_answer(predicted, reference, expected):
    assert same_answer(predicted, reference) is expected
