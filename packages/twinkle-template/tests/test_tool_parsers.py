"""Tool calls: rendered by the chat template, encoded, decoded and parsed back to the same calls, per format."""

from __future__ import annotations

import pytest

from twinkle.registry import build
from twinkle.template import Template, detect_tool_parser

CALLS = [
    {"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}},
    {"name": "get_weather", "arguments": {"city": "Zürich", "units": ["c", "f"], "days": 2}},
]
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("calculator", "get_weather")
]

# Llama 3.1's and Mistral's tool-call layouts, with this tokenizer's turn markers so turns end on its eos.
LLAMA3_JSON_TEMPLATE = r"""
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\n' -}}
{%- if message.tool_calls -%}
{{- '<|python_tag|>' -}}
{%- for call in message.tool_calls -%}
{%- if not loop.first -%}{{- '; ' -}}{%- endif -%}
{{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' -}}
{%- endfor -%}
{%- else -%}{{- message.content -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
MISTRAL_TEMPLATE = r"""
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\n' + message.content -}}
{%- if message.tool_calls -%}
{{- '[TOOL_CALLS][' -}}
{%- for call in message.tool_calls -%}
{%- if not loop.first -%}{{- ', ' -}}{%- endif -%}
{{- '{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}' -}}
{%- endfor -%}
{{- ']' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


def _completion_text(template: Template, trajectory: dict) -> str:
    """The decoded trained tokens of the one assistant turn, special tokens kept (what a sampler returns)."""
    feature = template.encode(trajectory)
    ids = [token for token, label in zip(feature["input_ids"], feature["labels"], strict=True) if label != -100]
    return template.decode(ids)


@pytest.mark.parametrize(
    ("chat_template", "parser", "content"),
    [(None, "hermes", "Let me check."), (LLAMA3_JSON_TEMPLATE, "llama3_json", ""), (MISTRAL_TEMPLATE, "mistral", "")],
)
def test_rendered_calls_parse_back(model_dir: str, chat_template: str | None, parser: str, content: str) -> None:
    template = Template(model_dir, max_length=None, chat_template=chat_template, enable_thinking=False)
    assert type(template.tool_parser) is type(build("tool_parser", parser))  # detected from the template
    trajectory = {
        "messages": [
            {"role": "user", "content": "What is 12 * (3 + 4), and the weather in Zürich?"},
            {"role": "assistant", "content": content, "tool_calls": CALLS},
        ],
        "tools": TOOLS,
    }
    message = template.parse_response(_completion_text(template, trajectory))
    assert message["tool_calls"] == CALLS
    assert message["content"] == content


def test_qwen3_reasoning_content_and_calls_are_separated(template: Template) -> None:
    text = '<think>\nI need the calculator.\n</think>\n\nSure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call><|im_end|>'  # noqa: E501
    assert template.parse_response(text) == {
        "role": "assistant",
        "content": "Sure.",
        "reasoning_content": "I need the calculator.",
        "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+2"}}],
    }


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>',  # truncated JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "calculator", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        "no call at all",
    ],
)
def test_what_is_not_a_call_stays_in_content(template: Template, text: str) -> None:
    message = template.parse_response(text)
    assert "tool_calls" not in message
    assert message["content"] == text.strip()


def test_arguments_written_as_a_json_string_are_decoded(template: Template) -> None:
    text = '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>'
    assert template.parse_response(text)["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "1+1"}}]


def test_an_unterminated_block_at_the_end_still_parses(template: Template) -> None:
    """A completion cut at a stop string before ``</tool_call>`` still holds a whole call."""
    text = 'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "3"}}\n'
    assert template.parse_response(text) == {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"name": "calculator", "arguments": {"expression": "3"}}],
    }


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("llama3_json", '{"name": "calculator", "parameters": {"expression": "3"}} and then some text'),
        ("llama3_json", "The answer is {1}"),
        ("mistral", "[TOOL_CALLS][{'name': 'single quotes are not JSON'}]"),
        ("mistral", '[TOOL_CALLS][{"name": "calculator", "arguments": 3}]'),
    ],
)
def test_other_formats_keep_malformed_calls_as_text(parser: str, text: str) -> None:
    assert build("tool_parser", parser).parse(text) == (text.strip(), [])


def test_detection_and_an_explicit_parser(model_dir: str) -> None:
    assert detect_tool_parser("{{ messages }}") is None
    plain = Template(model_dir, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert plain.tool_parser is None
    assert (
        plain.parse_response('<tool_call>{"name": "x"}</tool_call>')["content"]
        == '<tool_call>{"name": "x"}</tool_call>'
    )
    forced = Template(
        model_dir, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}", tool_parser="hermes"
    )
    assert forced.parse_response('<tool_call>{"name": "x"}</tool_call>')["tool_calls"] == [
        {"name": "x", "arguments": {}}
    ]


def test_encode_turns_continues_a_sampled_turn_as_the_chat_template_renders_it(template: Template, tokenizer) -> None:
    """The ids after the assistant's end-of-turn token, for a tool result and the next generation prompt."""
    history = [
        {"role": "user", "content": "What is 12 * (3 + 4)?"},
        {"role": "assistant", "content": "", "tool_calls": CALLS[:1]},
    ]
    turns = [{"role": "tool", "content": "84"}]
    whole = tokenizer.apply_chat_template([*history, *turns], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    continuation = template.encode_turns(history, turns, TOOLS)
    assert (
        template.decode(continuation) == whole[whole.rindex("</tool_call><|im_end|>") + len("</tool_call><|im_end|>") :]
    )
    assert template.decode(continuation).startswith("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>")
    with pytest.raises(Exception, match="must end with the assistant turn"):
        template.encode_turns(turns, history)
