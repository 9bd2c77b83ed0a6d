"""MessagesProcessor (OpenAI, ShareGPT, query/response) and DPOProcessor."""

from __future__ import annotations

import pytest

from twinkle.data_format import validate_trajectory
from twinkle.errors import InvalidInputError
from twinkle.preprocessor import DPOProcessor, MessagesProcessor


def test_openai_messages_with_tool_calls() -> None:
    row = {
        "messages": [
            {"role": "user", "content": "北京天气？"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}}
                ],
            },
            {"role": "tool", "content": "晴，25°C"},
            {"role": "assistant", "content": "北京今天晴，25°C。", "reasoning_content": "Use the tool result."},
        ],
        "tools": '[{"type": "function", "function": {"name": "get_weather"}}]',
    }
    trajectory = MessagesProcessor()(row)
    assert trajectory["messages"][1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "北京"}}],
    }
    assert trajectory["messages"][3]["reasoning_content"] == "Use the tool result."
    assert trajectory["tools"] == [{"type": "function", "function": {"name": "get_weather"}}]
    validate_trajectory(trajectory)


def test_sharegpt_conversations() -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "You are kind."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ]
    }
    assert MessagesProcessor(system="ignored, the row has one")(row)["messages"] == [
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]


def test_query_response_with_history_and_system() -> None:
    row = {"query": "再说一次", "response": "你好！", "history": [["你好", "你好！"]], "system": None}
    assert MessagesProcessor(system="Be brief.")(row)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "你好！"},
        {"role": "user", "content": "再说一次"},
        {"role": "assistant", "content": "你好！"},
    ]


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "narrator", "value": "..."}]},
            r"conversations\[1\]\.from is 'narrator'; expected one of",
        ),
        ({"messages": [{"role": "user", "content": ["image"]}]}, r"messages\[0\]\.content must be a string, got list"),
        ({"messages": []}, r"column 'messages' must be a non-empty list of messages"),
        ({"text": "hello"}, r"none of the columns 'messages', 'conversations' or 'query' \(row columns: \['text'\]\)"),
        (
            {"query": "q", "response": "r", "history": [["only one"]]},
            r"history\[0\] must be a \[query, response\] pair",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{bad"}]}]},
            r"messages\[0\]\.tool_calls\[0\]\.arguments is not valid JSON",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "{"}, r"column 'tools' is not valid JSON"),
    ],
)
def test_messages_bad_rows(row: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        MessagesProcessor()(row)


def test_dpo_with_strings() -> None:
    row = {"prompt": "What is 3 * 12?", "chosen": "3 * 12 = 36.", "rejected": "3 * 12 = 38."}
    trajectory = DPOProcessor(system="Answer briefly.")(row)
    prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 3 * 12?"}]
    assert trajectory == {
        "messages": [*prompt, {"role": "assistant", "content": "3 * 12 = 36."}],
        "rejected_messages": [*prompt, {"role": "assistant", "content": "3 * 12 = 38."}],
    }
    validate_trajectory(trajectory)
    validate_trajectory({"messages": trajectory["rejected_messages"]})


def test_dpo_with_message_lists() -> None:
    continuation = {
        "prompt": [{"role": "user", "content": "你好"}],
        "chosen": [{"role": "assistant", "content": "你好！有什么可以帮你？"}],
        "rejected": [{"role": "assistant", "content": "走开。"}],
    }
    trajectory = DPOProcessor()(continuation)
    assert trajectory["messages"][0] == {"role": "user", "content": "你好"}
    assert trajectory["rejected_messages"][-1] == {"role": "assistant", "content": "走开。"}
    # Whole conversations, HH-RLHF style, need no prompt column.
    whole = {
        "chosen": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}],
        "rejected": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Go away."}],
    }
    assert DPOProcessor()(whole)["rejected_messages"][1]["content"] == "Go away."


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "give the same conversation"),
        ({"prompt": "p", "chosen": "", "rejected": "r"}, "column 'chosen' is empty"),
        ({"prompt": "p", "chosen": "c"}, "column 'rejected' must be a non-empty list of messages, got None"),
        ({"chosen": "c", "rejected": "r"}, "column 'prompt' is missing or null but column 'chosen' holds only"),
        (
            {"prompt": "p", "chosen": "c", "rejected": [{"role": "user", "content": "no answer"}]},
            "column 'rejected' must end with a non-empty assistant answer",
        ),
    ],
)
def test_dpo_bad_rows(row: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        DPOProcessor()(row)
