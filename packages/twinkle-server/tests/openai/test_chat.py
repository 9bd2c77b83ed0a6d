"""OpenAI chat requests in Twinkle's terms, and completions back in OpenAI's: no model, no server."""

from __future__ import annotations

import json

import pytest

from twinkle.data_format import SampledSequence, SamplingParams
from twinkle.errors import InvalidInputError
from twinkle.server.contract import validate
from twinkle.server.openai import chat
from twinkle.server.openai.app import API
from twinkle.server.openai.schemas import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from twinkle.template import Template

CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def template() -> Template:
    return Template(model_id="builtin://qwen3-tiny")


def request(**options) -> ChatCompletionRequest:
    return validate(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **options})


def sequence(template: Template, text: str, visible: str | None = None) -> SampledSequence:
    """A completion whose tokens spell ``text`` (shown as ``visible``), with made-up log-probs and top-2
    alternatives."""
    tokens = template.tokenizer(text, add_special_tokens=False)["input_ids"]
    logprobs = [-0.1 * (i + 1) for i in range(len(tokens))]
    topk = [[(token, lp), (0, lp - 1.0)] for token, lp in zip(tokens, logprobs, strict=True)]
    decoded = template.decode(tokens, skip_special_tokens=True) if visible is None else visible
    return SampledSequence(tokens, "stop", logprobs, topk, decoded)


def test_openai_messages_become_twinkle_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
    body = request(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ],
        tools=[CALCULATOR],
    )
    trajectory = chat.conversation(body)
    assert trajectory["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
            ],
        },
        {"role": "tool", "content": "5"},
    ]
    assert trajectory["tools"] == [CALCULATOR]
    assert "tools" not in chat.conversation(request(tools=[CALCULATOR], tool_choice="none"))


def test_arguments_that_are_not_a_json_object_are_named():
    call = {"type": "function", "function": {"name": "calculator", "arguments": "[1]"}}
    body = request(messages=[{"role": "assistant", "content": "", "tool_calls": [call]}])
    with pytest.raises(InvalidInputError, match=r"messages\[0\].tool_calls\[0\].function.arguments") as error:
        chat.conversation(body)
    assert error.value.field == "messages.0.tool_calls.0.function.arguments"  # type: ignore[attr-defined]


def test_sampling_options_map_to_sampling_params():
    body = request(temperature=0, top_p=0.5, max_completion_tokens=7, stop="##", n=3, seed=4, logprobs=True)
    assert chat.sampling_params(body) == SamplingParams(
        max_tokens=7, temperature=0, top_p=0.5, stop=["##"], seed=4, num_samples=3, logprobs=True
    )
    assert chat.sampling_params(request(logprobs=True, top_logprobs=5)).logprobs == 5
    assert chat.sampling_params(request()) == SamplingParams()  # Twinkle's defaults where OpenAI says nothing


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"top_logprobs": 1}, None),
        ({"stream_options": {"include_usage": True}}, None),
        ({"max_tokens": 3, "max_completion_tokens": 4}, None),
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"messages": [{"role": "tool", "content": None}]}, "messages.0"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(options, field):
    with pytest.raises(InvalidInputError) as error:
        request(**options)
    assert getattr(error.value, "field", None) == field


def test_a_tool_call_completion_and_its_stream(template):
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'
    body = request(tools=[CALCULATOR], logprobs=True, top_logprobs=2, stream=True)
    answers = chat.answers([sequence(template, text)], template, chat.sampling_params(body))
    reply = chat.Reply(body, template, prompt_tokens=9)
    completion = ChatCompletion.model_validate(reply.completion(answers))
    [choice] = completion.choices
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "2+3"})
    assert completion.usage.total_tokens == 9 + len(answers[0].sequence.tokens)
    assert [entry.token for entry in choice.logprobs.content][-1] == "<|im_end|>"  # type: ignore[union-attr]

    chunks = [ChatCompletionChunk.model_validate(chunk) for chunk in reply.chunks(answers)]
    deltas = [chunk.choices[0].delta for chunk in chunks]
    streamed_calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert [(c.id, c.function.name, c.function.arguments) for c in streamed_calls] == [
        (call.id, call.function.name, call.function.arguments)
    ]
    streamed_logprobs = [
        e.logprob for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert streamed_logprobs == [entry.logprob for entry in choice.logprobs.content]  # type: ignore[union-attr]
    assert deltas[0].role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_plain_text_streams_token_by_token_and_stops_before_a_stop_string(template):
    body = request(stop=["##"], logprobs=True, stream=True, stream_options={"include_usage": True})
    completion = sequence(template, "Le café coûte 3 €. ##", visible="Le café coûte 3 €. ")  # as the sampler cuts it
    answers = chat.answers([completion], template, chat.sampling_params(body))
    reply = chat.Reply(body, template, prompt_tokens=4)
    content = reply.completion(answers)["choices"][0]["message"]["content"]
    chunks = list(reply.chunks(answers))
    pieces = [chunk["choices"][0]["delta"].get("content") for chunk in chunks[1:-2]]
    assert content == "Le café coûte 3 €. " == "".join(pieces)
    assert len(pieces) > 5 and "\ufffd" not in "".join(pieces)  # one piece per token, never half a character
    logprobs = [entry for chunk in chunks[1:-2] for entry in chunk["choices"][0]["logprobs"]["content"]]
    assert len(logprobs) == len(answers[0].sequence.tokens)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 4


def test_errors_are_in_openais_shape():
    reply = API.error_reply(InvalidInputError("temperature must be <= 2"))
    assert reply.status_code == 400
    body = json.loads(bytes(reply.body))
    assert body == {
        "error": {"message": "temperature must be <= 2", "type": "invalid_request_error", "param": None, "code": None}
    }
