"""A chat completion request as Twinkle's conversation and sampling parameters, and the sampler's answer
as OpenAI's ``chat.completion`` (or its stream of ``chat.completion.chunk`` events).

The prompt is rendered by the served model's chat template (tools included), exactly as training encodes
it; each completion is parsed back by the template (reasoning, content, tool calls).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from twinkle.data_format import Message, SampledSequence, SamplingParams, Trajectory
from twinkle.errors import InvalidInputError
from twinkle.server.openai.schemas import ChatCompletionRequest, ChatMessage


def conversation(request: ChatCompletionRequest) -> Trajectory:
    """The request's messages and tools in Twinkle's form (tool-call arguments decoded from their JSON)."""
    messages = [_message(message, index) for index, message in enumerate(request.messages)]
    trajectory: Trajectory = {"messages": messages}  # type: ignore[typeddict-item]  # validated by the template
    if request.tools and request.tool_choice != "none":  # "none": the model is not offered the tools
        trajectory["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]  # type: ignore[misc]
    return trajectory


def sampling_params(request: ChatCompletionRequest) -> SamplingParams:
    """The request's sampling options; unset ones keep Twinkle's defaults (OpenAI's where they agree)."""
    options: dict[str, Any] = {
        "max_tokens": request.max_completion_tokens or request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "seed": request.seed,
        "num_samples": request.n,
        "stop": [request.stop] if isinstance(request.stop, str) else request.stop,
    }
    params = SamplingParams(**{name: value for name, value in options.items() if value is not None})
    params.logprobs = request.top_logprobs or True  # an int k also returns the top k alternatives
    return params


@dataclass(frozen=True)
class Answer:
    """One choice: the assistant message the template parsed, and the tokens behind it."""

    index: int
    message: Message
    visible_text: str  # the completion's text, special tokens skipped, cut before a stop string
    finish_reason: str
    sequence: SampledSequence

    @property
    def structured(self) -> bool:
        """Whether the template found reasoning or tool calls: the content is then what it parsed out."""
        return bool(self.message.get("tool_calls")) or self.message.get("reasoning_content") is not None

    @property
    def reasoning(self) -> str | None:
        return (self.message.get("reasoning_content") or "").strip() or None


def answers(sequences: list[SampledSequence], template: Any, params: SamplingParams) -> list[Answer]:
    result = []
    for index, sequence in enumerate(sequences):
        raw = _cut_at_stop(template.decode(sequence.tokens), params.stop)  # special tokens kept: some mark tool calls
        message = template.parse_response(raw)
        finish = "tool_calls" if message.get("tool_calls") else "length" if sequence.stop_reason == "length" else "stop"
        result.append(Answer(index, message, sequence.decoded or "", finish, sequence))
    return result


class Reply:
    """Builds the ``chat.completion`` body, or the chunks of its stream, for one request."""

    def __init__(self, request: ChatCompletionRequest, template: Any, prompt_tokens: int) -> None:
        self.request, self.template, self.prompt_tokens = request, template, prompt_tokens
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def completion(self, answers: list[Answer]) -> dict[str, Any]:
        choices = []
        for answer in answers:
            message: dict[str, Any] = {"role": "assistant", "content": _content(answer)}
            if answer.reasoning is not None:
                message["reasoning_content"] = answer.reasoning
            if answer.message.get("tool_calls"):
                message["tool_calls"] = self._tool_calls(answer)
            tokens = range(len(answer.sequence.tokens))
            choice = {"index": answer.index, "message": message, "finish_reason": answer.finish_reason}
            choice["logprobs"] = {"content": self._logprobs(answer, tokens)} if self.request.logprobs else None
            choices.append(choice)
        return {**self._head("chat.completion"), "choices": choices, "usage": self._usage(answers)}

    def chunks(self, answers: list[Answer]) -> Iterator[dict[str, Any]]:
        """The stream: per choice, the role, then its text token by token (reasoning and tool calls in one
        piece each), then its finish reason; with ``include_usage`` a last chunk carries the usage."""
        for answer in answers:
            yield self._chunk(answer.index, {"role": "assistant", "content": ""})
            for delta, tokens in self._deltas(answer):
                logprobs = {"content": self._logprobs(answer, tokens)} if self.request.logprobs and tokens else None
                yield self._chunk(answer.index, delta, logprobs=logprobs)
            yield self._chunk(answer.index, {}, finish_reason=answer.finish_reason)
        options = self.request.stream_options
        if options is not None and options.include_usage:
            yield {**self._head("chat.completion.chunk"), "choices": [], "usage": self._usage(answers)}

    def _deltas(self, answer: Answer) -> Iterator[tuple[dict[str, Any], range]]:
        """``(delta, the tokens whose log-probs go with it)``."""
        every_token = range(len(answer.sequence.tokens))
        if answer.structured:
            if answer.reasoning is not None:
                yield {"reasoning_content": answer.reasoning}, range(0)
            if answer.message["content"]:
                yield {"content": answer.message["content"]}, range(0)
            for position, call in enumerate(self._tool_calls(answer)):
                yield {"tool_calls": [{"index": position, **call}]}, range(0)
            if self.request.logprobs:
                yield {}, every_token
            return
        tokens, visible = answer.sequence.tokens, answer.visible_text
        sent = start = 0
        for end in range(1, len(tokens) + 1):
            upto = len(visible)
            if end < len(tokens):
                prefix = self.template.decode(tokens[:end], skip_special_tokens=True)
                if prefix.endswith("\ufffd"):
                    continue  # a character split across tokens: wait for its last byte
                upto = min(len(prefix), upto)  # the visible text ends before a stop string
            if upto > sent or (self.request.logprobs and end == len(tokens)):
                yield {"content": visible[sent:upto]}, range(start, end)
                sent, start = max(sent, upto), end

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.request.model}

    def _usage(self, answers: list[Answer]) -> dict[str, int]:
        completion = sum(len(answer.sequence.tokens) for answer in answers)
        prompt = self.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _tool_calls(self, answer: Answer) -> list[dict[str, Any]]:
        """OpenAI's layout; ids made of the completion's id, the choice and the call's position."""
        calls = []
        for position, call in enumerate(answer.message.get("tool_calls") or []):
            function: Any = call.get("function", call)  # the parsers give {name, arguments}
            arguments = json.dumps(function["arguments"], ensure_ascii=False)
            call_id = f"call_{self.id.removeprefix('chatcmpl-')[:16]}_{answer.index}_{position}"
            named = {"name": function["name"], "arguments": arguments}
            calls.append({"id": call_id, "type": "function", "function": named})
        return calls

    def _logprobs(self, answer: Answer, tokens: range) -> list[dict[str, Any]]:
        sequence = answer.sequence
        entries = []
        for position in tokens:
            alternatives = sequence.topk_logprobs[position] if sequence.topk_logprobs else []
            entry = self._token(sequence.tokens[position], (sequence.logprobs or [])[position])
            entry["top_logprobs"] = [self._token(token, logprob) for token, logprob in alternatives]
            entries.append(entry)
        return entries

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.template.decode([token_id])
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def _content(answer: Answer) -> str | None:
    """The text a user sees: as decoded for a plain answer (what the stream adds up to), else what the
    template parsed out beside the reasoning and tool calls (None when only tools were called)."""
    if answer.structured:
        return answer.message["content"] or None
    return answer.visible_text


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    converted: dict[str, Any] = {"role": role, "content": message.text()}
    if message.reasoning_content is not None:
        converted["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        converted["tool_calls"] = [
            {"type": "function", "function": {"name": call.function.name, "arguments": _arguments(call, index, i)}}
            for i, call in enumerate(message.tool_calls)
        ]
    return converted


def _arguments(call: Any, index: int, position: int) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        arguments = exc
    if not isinstance(arguments, dict):
        error = InvalidInputError(f"messages[{index}].tool_calls[{position}].function.arguments is not a JSON object")
        error.field = f"messages.{index}.tool_calls.{position}.function.arguments"  # type: ignore[attr-defined]
        raise error
    return arguments


def _cut_at_stop(text: str, stop: list[str | int]) -> str:
    positions = [text.find(string) for string in stop if isinstance(string, str)]
    return text[: min((p for p in positions if p >= 0), default=len(text))]
