"""Training encodes: tokens identical to apply_chat_template, labels exactly on the assistant's output."""

from __future__ import annotations

import pickle

import pytest

from twinkle.data_format import IGNORE_INDEX, validate_input_feature
from twinkle.interfaces import Template as TemplateProtocol
from twinkle.template import Template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = {
    "single_turn": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    "system": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ]
    },
    "multi_turn_chinese": {
        "messages": [
            {"role": "user", "content": "你是谁？"},
            {"role": "assistant", "content": "我是twinkle模型，由twinkle团队开发。"},
            {"role": "user", "content": "你会做什么？"},
            {"role": "assistant", "content": "我可以回答问题、写代码。"},
        ]
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "2 plus 2 is 4."},
        ]
    },
    "tool_calls": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
            },
            {"role": "tool", "content": '{"temperature": 21}'},
            {"role": "assistant", "content": "It is 21°C in Paris."},
        ],
        "tools": [WEATHER_TOOL],
    },
    "prompt_only": {"messages": [{"role": "user", "content": "Only a question"}]},
}


def reference_ids(tokenizer, trajectory: dict, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(
        trajectory["messages"], tools=trajectory.get("tools"), tokenize=True, return_dict=False, **kwargs
    )


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_tokens_match_apply_chat_template(template: Template, tokenizer, name: str) -> None:
    trajectory = CONVERSATIONS[name]
    feature = template.encode(trajectory)
    assert feature["input_ids"] == reference_ids(tokenizer, trajectory, enable_thinking=True)
    assert validate_input_feature(feature, vocab_size=template.vocab_size) == feature
    assert feature["position_ids"] == list(range(feature["length"]))
    assert feature["attention_mask"] == [1] * feature["length"]
    assert feature["messages"] is trajectory["messages"]


def test_labels_are_unshifted_copies_of_assistant_tokens(template: Template) -> None:
    feature = template.encode(CONVERSATIONS["multi_turn_chinese"])
    for token, label, mask in zip(feature["input_ids"], feature["labels"], feature["loss_mask"], strict=True):
        assert label == (token if mask else IGNORE_INDEX)
    assert 0 < sum(feature["loss_mask"]) < feature["length"]


def test_every_assistant_turn_is_trained_through_its_end_of_turn_token(template: Template, trained) -> None:
    feature = template.encode(CONVERSATIONS["multi_turn_chinese"])
    # The historic turn is trained; the last one includes the empty think block the template inserts.
    assert trained(template, feature) == [
        "我是twinkle模型，由twinkle团队开发。<|im_end|>",
        "<think>\n\n</think>\n\n我可以回答问题、写代码。<|im_end|>",
    ]


def test_reasoning_content_is_trained(template: Template, trained) -> None:
    feature = template.encode(CONVERSATIONS["reasoning"])
    assert trained(template, feature) == ["<think>\n2 plus 2 is 4.\n</think>\n\n4<|im_end|>"]


def test_tool_calls_are_trained_and_tool_results_are_not(template: Template, trained) -> None:
    feature = template.encode(CONVERSATIONS["tool_calls"])
    assert trained(template, feature) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 21°C in Paris.<|im_end|>",
    ]


def test_openai_and_twinkle_tool_call_layouts_encode_alike(template: Template) -> None:
    twinkle_layout = CONVERSATIONS["tool_calls"]
    openai_messages = [dict(message) for message in twinkle_layout["messages"]]
    openai_messages[1]["tool_calls"] = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    openai_layout = {"messages": openai_messages, "tools": twinkle_layout["tools"]}
    assert template.encode(openai_layout)["labels"] == template.encode(twinkle_layout)["labels"]


def test_null_fields_from_datasets_tables_are_ignored(template: Template) -> None:
    # ``datasets`` stores absent optional keys as None.
    messages = [
        {"role": "user", "content": "Hi", "reasoning_content": None, "tool_calls": None},
        {"role": "assistant", "content": "Hello!", "reasoning_content": None, "tool_calls": None},
    ]
    plain = template.encode(CONVERSATIONS["single_turn"])
    assert template.encode({"messages": messages, "tools": None})["labels"] == plain["labels"]


def test_prompt_only_conversation_has_no_labels(template: Template) -> None:
    feature = template.encode(CONVERSATIONS["prompt_only"])
    assert sum(feature["loss_mask"]) == 0


def test_default_system_is_injected_only_when_missing(model_dir: str, tokenizer, trained) -> None:
    template = Template(model_dir, default_system="Answer in English.")
    single = CONVERSATIONS["single_turn"]
    with_default = [{"role": "system", "content": "Answer in English."}, *single["messages"]]
    feature = template.encode(single)
    assert feature["input_ids"] == reference_ids(tokenizer, {"messages": with_default})
    assert feature["messages"] == single["messages"]  # the trajectory itself is not rewritten
    assert trained(template, feature) == ["<think>\n\n</think>\n\nHello!<|im_end|>"]
    own_system = CONVERSATIONS["system"]
    assert template.encode(own_system)["input_ids"] == reference_ids(tokenizer, own_system)


def test_enable_thinking_false_leaves_the_empty_think_block_in_the_prompt(model_dir: str, tokenizer, trained) -> None:
    template = Template(model_dir, enable_thinking=False)
    trajectory = CONVERSATIONS["single_turn"]
    feature = template.encode(trajectory)
    assert feature["input_ids"] == reference_ids(tokenizer, trajectory, enable_thinking=False)
    assert trained(template, feature) == ["Hello!<|im_end|>"]


def test_user_data_passes_through(template: Template) -> None:
    trajectory = {**CONVERSATIONS["single_turn"], "user_data": {"answer": "42", "id": 7}}
    assert template.encode(trajectory)["user_data"] == {"answer": "42", "id": 7}


def test_batch_encode_and_decode_round_trip(template: Template, tokenizer) -> None:
    trajectories = [CONVERSATIONS["single_turn"], CONVERSATIONS["multi_turn_chinese"]]
    features = template.batch_encode(trajectories)
    texts = template.batch_decode([feature["input_ids"] for feature in features])
    assert texts == [tokenizer.apply_chat_template(t["messages"], tokenize=False) for t in trajectories]
    assert "<|im_start|>" not in template.decode(features[0]["input_ids"], skip_special_tokens=True)


def test_token_properties(template: Template, tokenizer) -> None:
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert template.eos_token_id == im_end
    assert template.eos_token_ids == [im_end, endoftext]  # tokenizer eos, then generation_config.json
    assert template.pad_token_id == tokenizer.pad_token_id
    assert template.vocab_size == len(tokenizer)


def test_satisfies_the_core_protocol_and_pickles(template: Template) -> None:
    # Datasets pickle the template to encode in worker processes.
    assert isinstance(template, TemplateProtocol)
    copy = pickle.loads(pickle.dumps(template))
    trajectory = CONVERSATIONS["multi_turn_chinese"]
    assert copy.encode(trajectory) == template.encode(trajectory)
