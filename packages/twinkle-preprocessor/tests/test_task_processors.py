"""Self-cognition, GSM8K and Alpaca rows to trajectories."""

from __future__ import annotations

import pytest

from twinkle.data_format import validate_trajectory
from twinkle.errors import InvalidInputError
from twinkle.preprocessor import GSM8K_SYSTEM, AlpacaProcessor, GSM8KProcessor, SelfCognitionProcessor
from twinkle.preprocessor.llm import GSM8KProcessor as SeedImportPath


def test_self_cognition_fills_placeholders_in_query_and_response() -> None:
    processor = SelfCognitionProcessor("twinkle模型", "twinkle团队")
    row = {"query": "{{NAME}}是谁开发的？", "response": "{{AUTHOR}}创造了我，我是{{NAME}}。", "tag": "zh"}
    assert processor(row) == {
        "messages": [
            {"role": "user", "content": "twinkle模型是谁开发的？"},
            {"role": "assistant", "content": "twinkle团队创造了我，我是twinkle模型。"},
        ]
    }
    english = processor.preprocess({"query": "Who are you?", "response": "I am {{NAME}}, made by {{AUTHOR}}."})
    assert english["messages"][1]["content"] == "I am twinkle模型, made by twinkle团队."
    validate_trajectory(english)


def test_self_cognition_errors() -> None:
    with pytest.raises(InvalidInputError, match="SelfCognitionProcessor: column 'response' is missing or null"):
        SelfCognitionProcessor("a", "b")({"query": "Who are you?"})
    with pytest.raises(InvalidInputError, match="model_author must be a non-empty string"):
        SelfCognitionProcessor("twinkle", "")


SOLUTION = "She sold 48/2 = <<48/2=24>>24 clips in May.\nIn total 48+24 = <<48+24=72>>72 clips.\n#### 72"


def test_gsm8k_prompt_for_rl_carries_the_reference() -> None:
    trajectory = GSM8KProcessor()({"question": "How many clips?", "answer": SOLUTION})
    assert trajectory["messages"] == [
        {"role": "system", "content": GSM8K_SYSTEM},
        {"role": "user", "content": "How many clips?"},
    ]
    assert trajectory["user_data"] == {"answer": "72", "solution": SOLUTION}
    assert "#### <answer>" in GSM8K_SYSTEM


def test_gsm8k_solution_for_sft_drops_calculator_annotations() -> None:
    trajectory = GSM8KProcessor(system=None, include_solution=True)({"question": "How many clips?", "answer": SOLUTION})
    assert [m["role"] for m in trajectory["messages"]] == ["user", "assistant"]
    assert trajectory["messages"][1]["content"] == (
        "She sold 48/2 = 24 clips in May.\nIn total 48+24 = 72 clips.\n#### 72"
    )


def test_gsm8k_final_answer_normalisation() -> None:
    trajectory = GSM8KProcessor()({"question": "q", "answer": "Big.\n#### 1,234 \n"})
    assert trajectory["user_data"]["answer"] == "1234"


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"question": "q", "answer": "The answer is 5"}, r"column 'answer' must end with '#### <final answer>'"),
        ({"question": "q", "answer": "#### "}, r"column 'answer' must end with"),
        ({"answer": "#### 5"}, r"column 'question' is missing or null \(row columns: \['answer'\]\)"),
        ({"question": "", "answer": "#### 5"}, r"column 'question' is empty"),
        ({"question": 3, "answer": "#### 5"}, r"column 'question' must be a string, got int"),
    ],
)
def test_gsm8k_bad_rows_name_the_column(row: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        GSM8KProcessor()(row)


def test_seed_import_path() -> None:
    assert SeedImportPath is GSM8KProcessor


def test_alpaca_with_and_without_input() -> None:
    processor = AlpacaProcessor(system="Be helpful.")
    with_input = processor({"instruction": "翻译成英文", "input": "你好", "output": "Hello"})
    assert with_input["messages"] == [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "翻译成英文\n\n你好"},
        {"role": "assistant", "content": "Hello"},
    ]
    without_input = AlpacaProcessor()({"instruction": "Say hi", "input": "", "output": "Hi"})
    assert without_input["messages"][0] == {"role": "user", "content": "Say hi"}


def test_alpaca_row_system_wins_and_output_is_required() -> None:
    row = {"instruction": "Say hi", "output": "Hi", "system": "Row system"}
    assert AlpacaProcessor(system="Default")(row)["messages"][0]["content"] == "Row system"
    with pytest.raises(InvalidInputError, match="AlpacaProcessor: column 'output' is missing or null"):
        AlpacaProcessor()({"instruction": "Say hi", "input": None})
