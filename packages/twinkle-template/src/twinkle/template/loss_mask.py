"""Which tokens of a rendered conversation are trained: the assistant's own output.

Chat templates are Jinja programs, so the one reliable way to know where an
assistant turn starts is to ask the template: rendering the messages *before*
message ``i`` with the generation prompt appended gives exactly the text the
model has seen when it starts writing message ``i``. The turn starts where that
prompt ends (so whatever the template puts after the generation prompt, such as
Qwen3's empty ``<think>`` block, is model output and trained) and runs through
the message's content, whatever the template renders after it in the same turn
(tool calls), and the end-of-turn token that teaches the model to stop.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from twinkle.template.errors import TemplateError

RenderPrompt = Callable[[list[dict[str, Any]]], str]  # chat templates take a list of dicts


def assistant_token_mask(
    messages: Sequence[dict[str, Any]],
    text: str,
    token_ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    render_prompt: RenderPrompt,
    end_of_turn_ids: Collection[int],
    special_ids: Collection[int],
    names: Sequence[str],
) -> list[int]:
    """1 for every token of an assistant turn in ``text``, else 0.

    ``offsets`` are the tokens' character spans in ``text`` (a fast tokenizer's
    offset mapping); ``render_prompt(messages[:i])`` renders with the generation
    prompt; ``names[i]`` names message ``i`` in errors. A token straddling the
    turn start (``"assistant:"`` + ``" Hello"``) is trained. After the content,
    tokens are followed up to the first end-of-turn token, which is included; if
    another special token (the next turn's header) or the end of the text comes
    first, the turn ends with its content: the template marks no end to learn.
    """
    token_starts = [start for start, _ in offsets]
    token_ends = [end for _, end in offsets]
    mask = [0] * len(token_ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        turn_start = _turn_start(index, messages, text, render_prompt, names)
        content_end = _content_end(message, text, turn_start, names[index])
        first = bisect_right(token_ends, turn_start)  # a token straddling the turn start carries output too
        after_content = bisect_left(token_starts, content_end)
        last = _through_end_of_turn(after_content, token_ids, end_of_turn_ids, special_ids)
        mask[first:last] = [1] * (last - first)
    return mask


def _turn_start(
    index: int, messages: Sequence[dict[str, Any]], text: str, render_prompt: RenderPrompt, names: Sequence[str]
) -> int:
    if index == 0:
        raise TemplateError(
            f"{names[0]} is an assistant message; a conversation must open with a system or user message "
            "so the template has a prompt before the first assistant turn"
        )
    prompt = render_prompt(list(messages[:index]))
    if not text.startswith(prompt):
        at = next((i for i, (a, b) in enumerate(zip(prompt, text, strict=False)) if a != b), len(text))
        raise TemplateError(
            f"the chat template is not prefix-stable at {names[index]}: the {index} messages before it, rendered "
            "with the generation prompt, are not a prefix of the whole conversation (they differ at character "
            f"{at}: {prompt[at : at + 40]!r} vs {text[at : at + 40]!r}), so the assistant turn cannot be located. "
            "The template rewrites earlier turns depending on later ones (for instance it drops reasoning_content "
            "of past turns); split the conversation or pass a prefix-stable chat_template="
        )
    return len(prompt)


def _content_end(message: Mapping[str, Any], text: str, turn_start: int, name: str) -> int:
    content = (message.get("content") or "").strip()
    if not content:
        return turn_start
    found = text.find(content, turn_start)
    if found < 0:
        raise TemplateError(
            f"{name}.content does not appear in the rendered text after its turn start: the chat template "
            "rewrites it (e.g. it removes a '<think>' block written into content; put reasoning into "
            "'reasoning_content' instead)"
        )
    return found + len(content)


def _through_end_of_turn(
    position: int, token_ids: Sequence[int], end_of_turn_ids: Collection[int], special_ids: Collection[int]
) -> int:
    """Index after the end-of-turn token that closes the turn, or ``position`` when none does."""
    for index in range(position, len(token_ids)):
        token_id = token_ids[index]
        if token_id in end_of_turn_ids:
            return index + 1
        if token_id in special_ids:
            break
    return position
