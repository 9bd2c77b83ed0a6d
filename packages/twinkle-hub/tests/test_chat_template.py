import json

import pytest

from twinkle.hub.models.chat_template import QWEN3_CHAT_TEMPLATE

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture
def render(tokenizer):
    def render(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    return render


def test_template_is_stored_in_tokenizer_config(tiny_model_dir):
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == QWEN3_CHAT_TEMPLATE


def test_single_turn_gets_an_empty_think_block(render):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert render(messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"
    )


def test_system_message_comes_first(render):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(messages) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_multi_turn_drops_reasoning_of_earlier_turns(render):
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>\nOne plus one.\n</think>\n\n2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."},
    ]
    assert render(messages) == (
        "<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo plus two.\n</think>\n\n4<|im_end|>\n"
    )


def test_reasoning_inside_content_is_split_out(render):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet.\n</think>\nHello!"},
    ]
    assert render(messages).endswith("<|im_start|>assistant\n<think>\nGreet.\n</think>\n\nHello!<|im_end|>\n")


@pytest.mark.parametrize(
    ("enable_thinking", "suffix"),
    [(True, "<|im_start|>assistant\n"), (False, "<|im_start|>assistant\n<think>\n\n</think>\n\n")],
)
def test_generation_prompt(render, enable_thinking, suffix):
    messages = [{"role": "user", "content": "Hi"}]
    rendered = render(messages, add_generation_prompt=True, enable_thinking=enable_thinking)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n" + suffix


def test_generation_prompt_defaults_to_thinking(render):
    assert render([{"role": "user", "content": "Hi"}], add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_tool_call_and_grouped_tool_responses(render):
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": "Sunny, 21C"},
        {"role": "tool", "content": "Rain, 17C"},
        {"role": "assistant", "content": "Paris is sunny; Rome is rainy."},
    ]
    expected_system = (
        "<|im_start|>system\nYou are a weather bot.\n\n"
        "# Tools\n\nYou may call the functions described below to help with the request.\n\n"
        "Their signatures are listed inside <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER_TOOL)
        + "\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments "
        "inside <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    expected_turns = (
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response>\n"
        "<tool_response>\nRain, 17C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nParis is sunny; Rome is rainy.<|im_end|>\n"
    )
    assert render(messages, tools=[WEATHER_TOOL]) == expected_system + expected_turns


def test_tool_call_after_text_starts_on_a_new_line(render):
    messages = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "Sunny"},
    ]
    assert render(messages) == (
        "<|im_start|>user\nParis?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n"
    )


def test_tokenized_rendering_matches_the_text(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(text) == [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]
