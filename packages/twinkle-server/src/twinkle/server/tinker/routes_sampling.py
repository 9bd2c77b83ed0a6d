"""Sampling clients: sessions on the base model, a saved checkpoint or a run's snapshot; ``asample``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types

from twinkle.data_format import SampleResponse
from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.contract import request_body
from twinkle.server.services.batches import SampleRequest, sample_slots
from twinkle.server.services.engine import PoolTask
from twinkle.server.store.base import Run
from twinkle.server.tinker import checkpoints, sampling
from twinkle.server.tinker.http import PREFIX, TinkerRoute, check_base_model, future, reply, tinker_caller
from twinkle.server.tinker.images import image_sizes
from twinkle.server.tinker.jobs import Caller, drop_sampler_adapters, submit
from twinkle.server.tinker.paths import sampler_id
from twinkle.server.tinker.replies import json_result
from twinkle.server.tinker.state import SamplingSession

router = APIRouter(prefix=PREFIX, route_class=TinkerRoute, tags=["tinker"])


def submit_snapshot(caller: Caller, run: Run, sampling_session_seq_id: int, kind: str, seq_id: int | None) -> str:
    """An ephemeral ``save_weights_for_sampler``: a sampling session on a copy of the run's adapter as it is now.

    ``snapshot`` copies are the session's own; ``inflight`` sessions of a run share one copy, refreshed by each save.
    The copy lives in the sampler of the pool holding the run, so the session's samples go there too.
    """
    session_id = sampler_id(run.session_id, sampling_session_seq_id)
    adapter = f"inflight:{run.id}" if kind == "inflight" else session_id
    base_model = run.metadata.get("base_model") or caller.state.config.model_id

    def finish(_: Any) -> bytes:
        if kind == "inflight":
            caller.tinker.add_inflight(run.id, adapter)
        else:
            drop_sampler_adapters(caller.state, caller.user, run.id, caller.tinker.add_snapshot(run.id, adapter))
        session = SamplingSession(session_id, caller.user, base_model, None, adapter=adapter, run_id=run.id)
        caller.tinker.add_session(session)
        return json_result({"sampling_session_id": session_id, "type": "save_weights_for_sampler"})

    task = PoolTask("snapshot_adapter", (run.id, adapter))
    return submit(
        caller, "save_weights_for_sampler", task, queue_key=run.id, run_id=run.id, seq_id=seq_id, finish=finish
    )


def _session_for(caller: Caller, session_id: str, base_model: str | None, model_path: str | None) -> SamplingSession:
    if model_path is not None:
        target = checkpoints.resolve(caller, model_path)
        source = caller.state.store.get_run(caller.user, target.run_id)
        name = base_model or (source.metadata.get("base_model") if source else None) or caller.state.config.model_id
        adapter = checkpoints.sampler_adapter_name(caller.user, target)
        return SamplingSession(session_id, caller.user, name, model_path, adapter)
    if base_model is None:
        raise InvalidInputError("a sampling client needs base_model or model_path")
    check_base_model(caller, base_model)
    return SamplingSession(session_id, caller.user, base_model, None, None)


@router.post("/create_sampling_session", response_model=types.CreateSamplingSessionResponse)
async def create_sampling_session(
    request: Request,
    body: Annotated[types.CreateSamplingSessionRequest, request_body(types.CreateSamplingSessionRequest)],
) -> JSONResponse:
    caller = tinker_caller(request)
    if caller.state.store.get_session(caller.user, body.session_id) is None:
        raise ResourceNotFoundError(f"no open session {body.session_id!r}")
    session_id = sampler_id(body.session_id, body.sampling_session_seq_id)
    caller.tinker.add_session(_session_for(caller, session_id, body.base_model, body.model_path))
    return reply({"sampling_session_id": session_id, "type": "create_sampling_session"})


@router.get("/samplers/{sampling_session_id}", response_model=types.GetSamplerResponse)
async def get_sampler(sampling_session_id: str, request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    session = caller.tinker.session(caller.user, sampling_session_id)
    return reply({"sampler_id": session.id, "base_model": session.base_model, "model_path": session.model_path})


@router.post("/asample", response_model=types.UntypedAPIFuture)
async def asample(
    request: Request, body: Annotated[types.SampleRequest, request_body(types.SampleRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)
    if body.sampling_session_id is not None:
        session = caller.tinker.session(caller.user, body.sampling_session_id)
    else:  # the legacy form names the weights on every request
        session = _session_for(caller, f"adhoc:{caller.user}", body.base_model, body.model_path)
    state, engine = caller.state, caller.state.engine
    text, images = sampling.prompt_images(body.prompt)
    params = sampling.sampling_params(body)
    vocab = engine.vocab_size
    if any(not 0 <= token < vocab for token in text):
        raise InvalidInputError(f"prompt has token ids outside the vocabulary [0, {vocab})")
    state.quotas.check_images(caller.user, image_sizes(images), "prompt")
    prompt = sampling.prompt_feature(text, images, engine.model_path, state.config.model_id)
    tokens = prompt["input_ids"]
    sampling.check_last_n(body.prompt_logprobs_last_n, len(tokens))
    if len(tokens) + params.max_tokens > engine.max_length:
        raise InvalidInputError(
            f"the prompt has {len(tokens)} tokens: with max_tokens={params.max_tokens} it exceeds the model's "
            f"{engine.max_length}-token context"
        )
    state.quotas.check_sampling(caller.user, len(tokens), 1, params.max_tokens, params.num_samples)

    queue_key = f"sample:{session.id}"  # a session's concurrent requests batch together (scheduler.py)
    replica = engine.replica_of(session.run_id or queue_key)  # a snapshot is in its run's pool; else any will do
    last_n, checkpoint, settled = body.prompt_logprobs_last_n, None, None
    adapter = session.adapter
    if session.model_path is not None:  # a saved checkpoint's weights, which must still exist (not expired)
        assert adapter is not None  # a checkpoint's session samples with that checkpoint's adapter
        _, hold = checkpoints.hold(caller, session.model_path)  # its files stay until this request is over
        settled = hold.release
        # Marked once a load succeeded (a deduplicated retry runs and marks nothing); requests sent before
        # then load it too.
        if not caller.tinker.is_loaded(adapter, replica):
            checkpoint = str(hold.path)
    shared = SampleRequest([prompt], params, adapter_name=adapter, checkpoint=checkpoint)

    def finish(response: SampleResponse) -> bytes:
        if checkpoint is not None:
            assert adapter is not None
            caller.tinker.mark_loaded(adapter, replica)
        return sampling.reply(response, params, last_n)

    key = None if body.seq_id is None else f"tinker-sample:{session.id}:{body.seq_id}"
    request_id = submit(
        caller,
        "sample",
        PoolTask("sample_one", (shared,)),
        queue_key=queue_key,
        key=key,
        tokens=sample_slots(len(tokens), 1, params.max_tokens, params.num_samples),
        shared=shared,
        replica=replica,
        finish=finish,
        settled=settled,
    )
    return future(request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(params.num_samples)])
