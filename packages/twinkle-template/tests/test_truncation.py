"""max_length and the four truncation strategies."""

from __future__ import annotations

import pytest

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.template import SequenceTooLongError, Template

LONG = {
    "messages": [
        {"role": "user", "content": "Count to ten."},
        {"role": "assistant", "content": "one two three four five six seven eight nine ten"},
    ]
}


@pytest.fixture(scope="module")
def full(template: Template) -> dict:
    return template.encode(LONG)


def with_limit(template: Template, max_length: int, strategy: str) -> Template:
    return Template(tokenizer=template.tokenizer, max_length=max_length, truncation_strategy=strategy)


def test_raise_names_the_length_and_the_limit(template: Template, full: dict) -> None:
    limited = with_limit(template, 10, "raise")
    with pytest.raises(SequenceTooLongError, match=rf"{full['length']} tokens, more than max_length=10") as info:
        limited.encode(LONG)
    assert isinstance(info.value, InvalidInputError)


def test_left_keeps_the_end(template: Template, full: dict) -> None:
    feature = with_limit(template, 10, "left").encode(LONG)
    assert feature["input_ids"] == full["input_ids"][-10:]
    assert feature["labels"] == full["labels"][-10:]
    assert feature["position_ids"] == list(range(10))


def test_right_keeps_the_start_even_when_no_label_survives(template: Template, full: dict) -> None:
    feature = with_limit(template, 5, "right").encode(LONG)
    assert feature["input_ids"] == full["input_ids"][:5]
    assert feature["length"] == 5
    assert sum(feature["loss_mask"]) == 0  # documented: the feature is kept and adds no loss


def test_delete_returns_none_and_batch_encode_keeps_positions(template: Template) -> None:
    limited = with_limit(template, 24, "delete")
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]}
    features = limited.batch_encode([LONG, short])
    assert features[0] is None
    assert features[1]["input_ids"] == template.encode(short)["input_ids"]


def test_a_too_long_rejected_side_deletes_the_pair(template: Template) -> None:
    pair = {
        "messages": [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "ok"}],
        "rejected_messages": LONG["messages"],
    }
    assert with_limit(template, 24, "delete").encode(pair) is None
    with pytest.raises(SequenceTooLongError, match="rejected_messages"):
        with_limit(template, 24, "raise").encode(pair)


def test_generation_prompts_are_truncated_too(template: Template) -> None:
    prompt = template.encode(LONG, add_generation_prompt=True)["input_ids"]
    assert with_limit(template, 4, "left").encode(LONG, add_generation_prompt=True)["input_ids"] == prompt[-4:]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"truncation_strategy": "split"}, "truncation_strategy must be one of"),
        ({"max_length": 0}, "max_length must be a positive int"),
    ],
)
def test_bad_truncation_arguments_fail_at_construction(template: Template, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Template(tokenizer=template.tokenizer, **kwargs)
