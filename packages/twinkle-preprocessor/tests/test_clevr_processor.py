"""CLEVR-style image rows to image-question trajectories."""

from __future__ import annotations

import pytest

from twinkle.data_format import validate_trajectory
from twinkle.errors import InvalidInputError
from twinkle.preprocessor import CLEVR_INSTRUCTION, CLEVRProcessor

ROW = {"image": "data:image/png;base64,iVBORw0KGgo=", "question": "How many red objects are there?", "answer": "2"}


def test_sft_and_prompt_only_trajectories() -> None:
    sft = CLEVRProcessor(include_answer=True)({**ROW, "type": "count_color"})
    assert sft == {
        "messages": [
            {"role": "user", "content": f"<image>How many red objects are there?\n{CLEVR_INSTRUCTION}"},
            {"role": "assistant", "content": "2"},
        ],
        "images": [ROW["image"]],
        "user_data": {"answer": "2", "type": "count_color"},
    }
    validate_trajectory(sft)
    prompt = CLEVRProcessor(instruction=None)(ROW)
    assert prompt["messages"] == [{"role": "user", "content": "<image>How many red objects are there?"}]
    assert prompt["user_data"] == {"answer": "2"}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({**ROW, "image": None}, "CLEVRProcessor: column 'image' is missing or empty"),
        ({k: v for k, v in ROW.items() if k != "question"}, "CLEVRProcessor: column 'question' is missing"),
        ({**ROW, "answer": " "}, "CLEVRProcessor: column 'answer' is empty"),
    ],
)
def test_bad_rows_name_the_column(row, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        CLEVRProcessor()(row)
