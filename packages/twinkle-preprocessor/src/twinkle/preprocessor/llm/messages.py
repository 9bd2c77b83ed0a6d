"""Chat rows in the common public formats, normalised to Twinkle ``messages``.

Formats: OpenAI ``messages`` ``[{role, content, tool_calls?}]``, ShareGPT
``conversations`` ``[{from, value}]`` and the ``{query, response, history?, system?}``
rows of ms-swift style datasets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, ToolCall, Trajectory
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.preprocessor.columns import text_column
from twinkle.registry import register

# Role names used by public datasets, lower-cased, to Twinkle roles.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def normalize_messages(raw: Any, column: str, processor: str) -> list[Message]:
    """A list of ``{role, content}`` or ``{from, value}`` dicts as Twinkle messages.

    Errors name the processor, the column and the message index.
    """
    if not isinstance(raw, list) or not raw:
        raise InvalidInputError(f"{processor}: column {column!r} must be a non-empty list of messages, got {raw!r:.80}")
    return [_message(item, f"{column}[{index}]", processor) for index, item in enumerate(raw)]


def prepend_system(messages: list[Message], system: str | None) -> list[Message]:
    """``messages`` with a system message in front when ``system`` is given and none is there."""
    if not system or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def _message(item: Any, where: str, processor: str) -> Message:
    if not isinstance(item, Mapping):
        raise InvalidInputError(f"{processor}: {where} must be a dict, got {type(item).__name__}")
    role_key, content_key = ("role", "content") if "role" in item else ("from", "value")
    role_value = item.get(role_key)
    role = ROLE_ALIASES.get(role_value.lower()) if isinstance(role_value, str) else None
    if role is None:
        raise InvalidInputError(
            f"{processor}: {where}.{role_key} is {role_value!r}; expected one of {sorted(ROLE_ALIASES)}"
        )
    content = item.get(content_key)
    if content is None:  # OpenAI assistant turns that only call tools
        content = ""
    if not isinstance(content, str):
        raise InvalidInputError(f"{processor}: {where}.{content_key} must be a string, got {type(content).__name__}")
    message: Message = {"role": role, "content": content}  # type: ignore[typeddict-item]
    if item.get("reasoning_content"):
        message["reasoning_content"] = item["reasoning_content"]
    if item.get("tool_calls"):
        message["tool_calls"] = [
            _tool_call(call, f"{where}.tool_calls[{index}]", processor) for index, call in enumerate(item["tool_calls"])
        ]
    return message


def _tool_call(call: Any, where: str, processor: str) -> ToolCall:
    """``{name, arguments}`` or OpenAI's ``{type, function: {name, arguments}}``; JSON-string arguments are parsed."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidInputError(f"{processor}: {where} must be a dict with a function 'name', got {call!r:.80}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{processor}: {where}.arguments is not valid JSON: {exc}") from exc
    if not isinstance(arguments, Mapping):
        raise InvalidInputError(f"{processor}: {where}.arguments must be a JSON object, got {arguments!r:.80}")
    return {"name": function["name"], "arguments": dict(arguments)}


def _tools(tools: Any, processor: str) -> list[Any]:
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{processor}: column 'tools' is not valid JSON: {exc}") from exc
    if not isinstance(tools, list):
        raise InvalidInputError(f"{processor}: column 'tools' must be a list of tools, got {type(tools).__name__}")
    return tools


@register("preprocessor")
class MessagesProcessor(Preprocessor):
    """Normalises ``messages``, ``conversations`` (ShareGPT) or ``query``/``response`` rows.

    The first of those columns present is used; a ``tools`` column (a list or
    its JSON string) is kept. ``system`` is prepended where a row has none.
    """

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        name = type(self).__name__
        if row.get("messages") is not None:
            messages = normalize_messages(row["messages"], "messages", name)
        elif row.get("conversations") is not None:
            messages = normalize_messages(row["conversations"], "conversations", name)
        elif row.get("query") is not None:
            messages = self._query_response(row)
        else:
            raise InvalidInputError(
                f"{name}: row has none of the columns 'messages', 'conversations' or 'query' "
                f"(row columns: {sorted(row)})"
            )
        trajectory: Trajectory = {"messages": prepend_system(messages, self.system)}
        tools = row.get("tools")
        if tools:
            trajectory["tools"] = _tools(tools, name)
        return trajectory

    def _query_response(self, row: Mapping[str, Any]) -> list[Message]:
        name = type(self).__name__
        system = text_column(row, "system", name, required=False)
        messages: list[Message] = [{"role": "system", "content": system}] if system else []
        for index, turn in enumerate(row.get("history") or []):
            if not isinstance(turn, (list, tuple)) or len(turn) != 2 or not all(isinstance(t, str) for t in turn):
                raise InvalidInputError(f"{name}: history[{index}] must be a [query, response] pair, got {turn!r:.80}")
            messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
        messages.append({"role": "user", "content": text_column(row, "query", name)})
        messages.append({"role": "assistant", "content": text_column(row, "response", name)})
        return messages
