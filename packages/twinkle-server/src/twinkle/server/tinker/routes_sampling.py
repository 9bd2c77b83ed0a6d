"""Sampling clients: sessions on the base model, a saved checkpoint or a run's snapshot; ``asample``."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types

from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.store.base import Run
from twinkle.server.tinker import checkpoints, sampling
from twinkle.server.tinker.http import PREFIX, check_base_model, future, parse, reply, tinker_caller
from twinkle.server.tinker.jobs import Caller, submit
from twinkle.server.tinker.paths import sampler_id
from twinkle.server.tinker.replies import json_result
from twinkle.server.tinker.state import SamplingSession

router = APIRouter(prefix=PREFIX)


def snapshot_work(caller: Caller, run: Run, sampling_session_seq_id: int, kind: str) -> Callable[[], bytes]:
    """An ephemeral ``save_weights_for_sampler``: a sampling session on a copy of the run's adapter as it is now.

    ``snapshot`` copies are the session's own; ``inflight`` sessions of a run share one copy, refreshed by each save.
    """
    session_id = sampler_id(run.session_id, sampling_session_seq_id)
    adapter = f"inflight:{run.id}" if kind == "inflight" else session_id
    base_model = run.metadata.get("base_model") or caller.state.config.model_id

    def work() -> bytes:
        pool = caller.state.pool
        pool.snapshot_adapter(run.id, adapter)
        if kind == "inflight":
            caller.tinker.add_inflight(run.id, adapter)
        else:
            for old in caller.tinker.add_snapshot(run.id, adapter):
                pool.drop_sampler_adapter(old)
        session = SamplingSession(session_id, caller.user, base_model, None, adapter=adapter, run_id=run.id)
        caller.tinker.add_session(session)
        return json_result({"sampling_session_id": session_id, "type": "save_weights_for_sampler"})

    return work


def _session_for(caller: Caller, session_id: str, base_model: str | None, model_path: str | None) -> SamplingSession:
    if model_path is not None:
        target, directory = checkpoints.resolve(caller, model_path)
        source = caller.state.store.get_run(caller.user, target.run_id)
        name = base_model or (source.metadata.get("base_model") if source else None) or caller.state.config.model_id
        adapter = checkpoints.sampler_adapter_name(caller.user, target)
        return SamplingSession(session_id, caller.user, name, model_path, adapter, directory=str(directory))
    if base_model is None:
        raise InvalidInputError("a sampling client needs base_model or model_path")
    check_base_model(caller, base_model)
    return SamplingSession(session_id, caller.user, base_model, None, None)


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> JSONResponse:
    caller, body = tinker_caller(request), await parse(request, types.CreateSamplingSessionRequest)
    if caller.state.store.get_session(caller.user, body.session_id) is None:
        raise ResourceNotFoundError(f"no open session {body.session_id!r}")
    session_id = sampler_id(body.session_id, body.sampling_session_seq_id)
    caller.tinker.add_session(_session_for(caller, session_id, body.base_model, body.model_path))
    return reply({"sampling_session_id": session_id, "type": "create_sampling_session"})


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    session = caller.tinker.session(caller.user, sampling_session_id)
    return reply({"sampler_id": session.id, "base_model": session.base_model, "model_path": session.model_path})


@router.post("/asample")
async def asample(request: Request) -> JSONResponse:
    caller, body = tinker_caller(request), await parse(request, types.SampleRequest)
    if body.sampling_session_id is not None:
        session = caller.tinker.session(caller.user, body.sampling_session_id)
    else:  # the legacy form names the weights on every request
        session = _session_for(caller, f"adhoc:{caller.user}", body.base_model, body.model_path)
    state = caller.state
    tokens = sampling.prompt_tokens(body.prompt)
    params = sampling.sampling_params(body)
    sampling.check_last_n(body.prompt_logprobs_last_n, len(tokens))
    vocab = state.pool.model.vocab_size
    if any(not 0 <= token < vocab for token in tokens):
        raise InvalidInputError(f"prompt has token ids outside the vocabulary [0, {vocab})")
    if len(tokens) + params.max_tokens > state.pool.max_length:
        raise InvalidInputError(
            f"the prompt has {len(tokens)} tokens: with max_tokens={params.max_tokens} it exceeds the model's "
            f"{state.pool.max_length}-token context"
        )
    state.quotas.check_tokens(caller.user, len(tokens) * params.num_samples)

    def work() -> bytes:
        if session.directory is not None and caller.tinker.mark_loaded(session.adapter):
            try:
                state.pool.load_sampler_adapter(session.adapter, session.directory)
            except Exception:
                caller.tinker.forget_loaded(session.adapter)
                raise
        return sampling.sample(state.pool, session.adapter, tokens, params, body.prompt_logprobs_last_n)

    key = None if body.seq_id is None else f"tinker-sample:{session.id}:{body.seq_id}"
    request_id = submit(caller, "sample", work, queue_key=f"sample:{session.id}", key=key, tokens=len(tokens))
    return future(request_id, sample_sequence_ids=[f"{request_id}:{i}" for i in range(params.num_samples)])
