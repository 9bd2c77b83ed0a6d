"""Tool-call parsers: the text a model wrote back into an assistant :class:`~twinkle.data_format.Message`.

The chat template renders tool calls into the prompt; a parser reads the same
format out of a completion, so that ``render -> tokens -> parse`` gives back
the calls. Each format is a registered ``tool_parser``:

- ``hermes`` (Qwen2.5, Qwen3, QwQ, Hermes): ``<tool_call>{"name", "arguments"}</tool_call>`` blocks;
- ``llama3_json`` (Llama 3.1-3.3): the turn is a JSON ``{"name", "parameters"}`` object (or several,
  separated by ``;``), optionally after ``<|python_tag|>``;
- ``mistral`` (Mistral, Mixtral): ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}``.

A block that is not a valid call (bad JSON, no name, arguments not an
object) stays in ``content``: the caller sees what the model wrote, and an
environment can answer it with an error.
"""

from __future__ import annotations

import json
import re
from typing import Any

from twinkle.data_format import Message, ToolCall
from twinkle.interfaces import ToolCallParser
from twinkle.registry import register


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    """``obj`` as a tool call, or ``None`` when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": obj["name"], "arguments": arguments}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@register("tool_parser", name="hermes")
class HermesToolParser:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them."""

    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        kept: list[str] = []
        position = 0
        for match in self._BLOCK.finditer(text):
            call = _call(_loads(match.group(1).strip()), "arguments")
            if call is None:
                continue
            calls.append(call)
            kept.append(text[position : match.start()])
            position = match.end()
        kept.append(text[position:])
        return "".join(kept).strip(), calls


@register("tool_parser", name="llama3_json")
class Llama3JsonToolParser:
    """A turn that is only ``{"name": ..., "parameters": {...}}`` objects joined by ``;`` (Llama 3.1-3.3)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text.strip(), []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while True:
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text.strip(), []
            call = _call(obj, "parameters") or _call(obj, "arguments")
            if call is None:
                return text.strip(), []
            calls.append(call)
            rest = body[end:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return text.strip(), []
            position = len(body) - len(rest[1:].lstrip())
        return "", calls


@register("tool_parser", name="mistral")
class MistralToolParser:
    """``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` objects, after any text."""

    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        head, marker, tail = text.partition(self.MARKER)
        if not marker:
            return text.strip(), []
        try:
            obj, end = json.JSONDecoder().raw_decode(tail.strip())
        except json.JSONDecodeError:
            return text.strip(), []
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call(item, "arguments") for item in items]
        if not calls or any(call is None for call in calls):
            return text.strip(), []
        return (head + tail.strip()[end:]).strip(), calls  # type: ignore[return-value]


# What in a chat template's source gives its tool-call format away, most specific first.
_FORMAT_MARKERS: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The registered parser for the tool-call format ``chat_template`` renders, or ``None`` when unknown."""
    if not chat_template:
        return None
    return next((name for marker, name in _FORMAT_MARKERS if marker in chat_template), None)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of a completion that opens with a ``<think>...</think>`` block (Qwen3, QwQ, R1).

    Templates may pre-fill ``<think>`` in the generation prompt, so a completion
    holding only the closing tag counts as well.
    """
    head, closing, rest = text.partition("</think>")
    if not closing:
        return None, text
    return head.split("<think>", 1)[-1].strip("\n"), rest.lstrip("\n")


def assistant_message(text: str, parser: ToolCallParser | None) -> Message:
    """The assistant message a completion stands for: reasoning, content and tool calls separated."""
    reasoning, rest = split_reasoning(text)
    content, calls = parser.parse(rest) if parser is not None else (rest.strip(), [])
    message: Message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = list(calls)
    return message
