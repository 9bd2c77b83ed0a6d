"""Request and reply bodies of the OpenAI-compatible API, as the ``openai`` SDK sends and reads them.

Parameters this server cannot honour are refused by name (a 400), never silently ignored:
penalties, ``logit_bias``, forced tool choice, structured output. ``top_k`` and
``chat_template_kwargs`` are vLLM's extensions (the SDK passes them with ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 128  # OpenAI's own bound on n
MAX_TOP_LOGPROBS = 20


class Body(BaseModel):
    """A request body: an unknown parameter is an error naming it, as OpenAI answers."""

    model_config = ConfigDict(extra="forbid")


class Reply(BaseModel):
    """A reply body: clients ignore fields they do not know."""


class ChatTextPart(Body):
    type: Literal["text"]
    text: str


class ChatFunctionCall(Body):
    name: str
    arguments: str = Field(description="The call's arguments as a JSON object, encoded as a string")


class ChatToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ChatFunctionCall


class ChatMessage(Body):
    """One message of the conversation; ``developer`` is treated as ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatTextPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatFunctionDefinition(Body):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Body):
    type: Literal["function"]
    function: ChatFunctionDefinition


class ChatStreamOptions(Body):
    include_usage: bool = False


class ChatResponseFormat(Body):
    type: Literal["text"]


class ChatTemplateKwargs(Body):
    enable_thinking: bool | None = None


class ChatCompletionRequest(Body):
    """``POST /v1/chat/completions``: ``model`` is an id from ``GET /v1/models``."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto"] | None = Field(
        None, description="'auto' (with tools) or 'none'; forcing a call is not supported"
    )
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    stream: bool | None = None
    stream_options: ChatStreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ChatResponseFormat | None = None
    user: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported by this server; use 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self


class OpenAIModel(Reply):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class OpenAIModelList(Reply):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class ChatTopLogprob(Reply):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatChoiceLogprobs(Reply):
    content: list[ChatTokenLogprob] | None


class ChatReplyFunctionCall(Reply):
    name: str
    arguments: str = Field(description="The call's arguments as a JSON object, encoded as a string")


class ChatReplyToolCall(Reply):
    id: str
    type: Literal["function"]
    function: ChatReplyFunctionCall


class ChatReplyMessage(Reply):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ChatReplyToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(Reply):
    index: int
    message: ChatReplyMessage
    finish_reason: FinishReason
    logprobs: ChatChoiceLogprobs | None = None


class ChatUsage(Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(Reply):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage


class ChatToolCallDelta(Reply):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChatReplyFunctionCall


class ChatDelta(Reply):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCallDelta] | None = None


class ChatChunkChoice(Reply):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChatChoiceLogprobs | None = None


class ChatCompletionChunk(Reply):
    """One server-sent event of a streamed completion (``data: {...}``; the stream ends with ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: ChatUsage | None = None


class OpenAIErrorDetail(Reply):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(Reply):
    """An error reply in OpenAI's shape (the SDK raises it as ``openai.APIStatusError`` subclasses)."""

    error: OpenAIErrorDetail
