"""``/v1/models`` and ``/v1/chat/completions``, authenticated with the server's API keys (``Authorization: Bearer``).

A completion is one sampling task on the engine, queued like every other call (behind the run's training
calls when ``model`` is a run); the route waits for it without holding a thread. With ``stream=true`` the
reply is a server-sent event stream of ``chat.completion.chunk`` objects, sent once the sampler is done
(the sampler generates a request's tokens in one call).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from twinkle.data_format import SampleResponse
from twinkle.errors import InvalidInputError
from twinkle.server.app.http import caller
from twinkle.server.app.state import ServerState
from twinkle.server.contract import ContractRoute, request_body
from twinkle.server.openai import chat, models
from twinkle.server.openai.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    OpenAIError,
    OpenAIModel,
    OpenAIModelList,
)
from twinkle.server.openai.state import OpenAIState
from twinkle.server.services.batches import sample_slots
from twinkle.server.services.engine import PoolTask
from twinkle.server.services.futures import api_method

PREFIX = "/v1"
API = "openai"
STREAM_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


class OpenAIRoute(ContractRoute):
    error_model = OpenAIError


router = APIRouter(prefix=PREFIX, route_class=OpenAIRoute, tags=["openai"])


@router.get("/models", response_model=OpenAIModelList)
async def list_models(request: Request) -> JSONResponse:
    user = caller(request)
    return JSONResponse({"object": "list", "data": models.list_models(_server(request), user)})


@router.get("/models/{model:path}", response_model=OpenAIModel)
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    user = caller(request)
    return JSONResponse({"object": "model", **models.find_model(_server(request), user, model)})


@router.post("/chat/completions", response_model=ChatCompletion, responses=STREAM_DOC)
async def chat_completions(
    request: Request, body: Annotated[ChatCompletionRequest, request_body(ChatCompletionRequest)]
) -> Response:
    user, state = caller(request), _server(request)
    spec = {"name": "Template", "kwargs": _template_kwargs(body)}
    template = state.engine.template(spec)
    feature = await run_in_threadpool(template.encode, chat.conversation(body), True)
    prompt = list(feature["input_ids"])
    params = chat.sampling_params(body)
    if len(prompt) + params.max_tokens > state.engine.max_length:
        raise InvalidInputError(
            f"the messages take {len(prompt)} tokens: with max_tokens={params.max_tokens} they exceed the "
            f"model's {state.engine.max_length}-token context"
        )
    state.quotas.check_sampling(user, len(prompt), 1, params.max_tokens, params.num_samples)
    target = models.resolve(state, user, body.model)
    try:
        openai_state: OpenAIState = request.app.state.openai
        if target.adapter is not None:
            openai_state.loaded(target.adapter, state.engine.replica_of(target.queue_key))
        response = await _sample(state, user, target, [{"input_ids": prompt}], params)
    finally:
        target.release()
    reply = chat.Reply(body, template, len(prompt))
    answers = chat.answers(response.sequences, template, params)
    if body.stream:
        return StreamingResponse(_events(reply.chunks(answers)), media_type="text/event-stream")
    return JSONResponse(reply.completion(answers))


async def _sample(
    state: ServerState, user: str, target: models.SamplingTarget, inputs: list[dict[str, Any]], params: Any
) -> SampleResponse:
    """Run the sampling task on the engine and wait for it here, on the event loop."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[SampleResponse] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():  # the client may have gone: nobody waits any more
            done.set_exception(error) if error is not None else done.set_result(result)

    def on_done(result: Any, error: BaseException | None) -> None:
        loop.call_soon_threadsafe(settle, result, error)

    labels = (user, api_method(API, "chat.completions"))
    slots = sample_slots(len(inputs[0]["input_ids"]), 1, params.max_tokens, params.num_samples)
    request = target.request(inputs, params)
    state.engine.submit(target.queue_key, PoolTask("sample_one", (request,)), on_done, request, slots, labels)
    return await done


def _events(chunks: Iterator[dict[str, Any]]) -> Iterator[str]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    options = body.chat_template_kwargs
    return {} if options is None else options.model_dump(exclude_none=True)


def _server(request: Request) -> ServerState:
    return request.app.state.server
