"""Chat rows: :class:`Message`, :class:`Tool` and :class:`Trajectory`.

Rows are plain dicts (``TypedDict``) because they live in Hugging Face
``datasets`` tables and in JSON bodies; :func:`validate_trajectory` checks one
and returns it unchanged, raising :class:`InvalidInputError` that names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from annotated_types import MinLen
from typing_extensions import NotRequired, TypedDict  # pydantic (the server's HTTP schemas) needs this TypedDict

from twinkle.errors import InvalidInputError

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


class ToolCall(TypedDict):
    """A function call made by the assistant; ``arguments`` is a JSON object."""

    name: str
    arguments: dict[str, Any]


class FunctionToolCall(TypedDict):
    """The OpenAI layout of a tool call, accepted as well: ``{"type": "function", "function": {name, arguments}}``."""

    type: NotRequired[str]  # "function"; the templates do not read it
    function: ToolCall


class Message(TypedDict):
    """One chat turn. ``reasoning_content`` holds a thinking trace (Qwen3 style)."""

    role: Role
    content: str
    # None as absent: dataset rows fill columns a message lacks with None
    reasoning_content: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall | FunctionToolCall] | None]


class Tool(TypedDict):
    """An OpenAI-style tool (function) description offered to the model."""

    type: str
    function: dict[str, Any]


class Trajectory(TypedDict):
    """A conversation plus task data.

    ``user_data`` carries whatever rewards need later (ground-truth answers,
    ids); it travels unchanged through encoding into the ``InputFeature``.
    ``rejected_messages`` makes it a preference pair: the rejected alternative
    of ``messages`` (the chosen one), with the same prompt.

    ``images`` (vision-language models) holds one image per ``<image>``
    placeholder in the messages' contents, in order: a local path (or a
    ``file://`` URL, or a ``data:image/...;base64,`` URI), the encoded bytes,
    a ``{"bytes": ..., "path": ...}`` dict as ``datasets`` stores images, or a
    PIL image. A preprocessor's output in ``Dataset.map`` is stored as JSON, so
    there only paths and URIs (strings) can be given.
    """

    messages: Annotated[list[Message], MinLen(1)]  # bounds as validate_trajectory enforces them, for schemas
    images: NotRequired[list[Any]]
    tools: NotRequired[list[Tool]]
    user_data: NotRequired[dict[str, Any]]
    rejected_messages: NotRequired[Annotated[list[Message], MinLen(1)]]


def validate_message(message: Any, where: str = "message") -> Message:
    """Check one message; ``where`` prefixes error messages (e.g. ``messages[2]``)."""
    if not isinstance(message, Mapping):
        raise InvalidInputError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidInputError(f"{where}.role must be one of {ROLES}, got {role!r}")
    content = message.get("content")
    if not isinstance(content, str):
        raise InvalidInputError(f"{where}.content must be a string, got {type(content).__name__}")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise InvalidInputError(f"{where}.reasoning_content must be a string when given")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise InvalidInputError(f"{where}.tool_calls must be a list of {{'name', 'arguments'}} objects")
        for i, call in enumerate(tool_calls):
            function = call.get("function", call) if isinstance(call, Mapping) else None
            if not (
                isinstance(function, Mapping)
                and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), Mapping)
                and isinstance(call.get("type", ""), str)
            ):
                raise InvalidInputError(
                    f"{where}.tool_calls[{i}] must be {{'name': str, 'arguments': {{...}}}} (or OpenAI's "
                    f"{{'function': {{...}}}}), got {call!r:.80}"
                )
    return message  # type: ignore[return-value]


def validate_trajectory(row: Any, where: str = "trajectory") -> Trajectory:
    """Check a trajectory row: a non-empty ``messages`` list of valid messages (``rejected_messages`` too, when
    given), ``tools`` a list of tool objects."""
    if not isinstance(row, Mapping):
        raise InvalidInputError(f"{where} must be a dict with a 'messages' list, got {type(row).__name__}")
    for key in ("messages", "rejected_messages"):
        messages = row.get(key)
        if key == "rejected_messages" and messages is None:
            continue
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError(f"{where}.{key} must be a non-empty list of messages, got {messages!r:.80}")
        for i, message in enumerate(messages):
            validate_message(message, f"{where}.{key}[{i}]")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, Mapping) for tool in tools)):
        raise InvalidInputError(f"{where}.tools must be a list of tool objects when given")
    images = row.get("images")
    if images is not None:
        if not isinstance(images, list):
            raise InvalidInputError(f"{where}.images must be a list of images, got {type(images).__name__}")
        for i, image in enumerate(images):
            if not _is_image(image):
                raise InvalidInputError(
                    f"{where}.images[{i}] must be a path, a data URI, bytes, a {{'bytes', 'path'}} dict or a PIL "
                    f"image, got {type(image).__name__}"
                )
    user_data = row.get("user_data")
    if user_data is not None and not isinstance(user_data, Mapping):
        raise InvalidInputError(f"{where}.user_data must be a dict when given")
    return row  # type: ignore[return-value]


def _is_image(value: Any) -> bool:
    """Whether ``value`` has a form an image can take in a trajectory (decoding is the template's)."""
    if isinstance(value, (str, bytes)):
        return bool(value)
    if isinstance(value, Mapping):
        return bool(value.get("bytes") or value.get("path"))
    return hasattr(value, "convert") and hasattr(value, "size")  # PIL.Image.Image, without importing PIL
