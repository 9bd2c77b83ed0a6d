"""The ``RestClient`` endpoints: training runs, their checkpoints, and weights info."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import Field
from tinker import types

from twinkle.errors import ResourceNotFoundError
from twinkle.server.app.schemas.common import Body, Empty
from twinkle.server.app.schemas.runs import SetTtl
from twinkle.server.contract import request_body
from twinkle.server.store.base import Checkpoint, Run
from twinkle.server.tinker import checkpoints
from twinkle.server.tinker.http import PREFIX, TinkerRoute, owned_run, reply, tinker_caller
from twinkle.server.tinker.jobs import Caller
from twinkle.server.tinker.paths import CheckpointPath, parse_checkpoint_id, parse_path


class WeightsInfo(Body):
    """What the SDK's ``RestClient.get_weights_info_by_tinker_path`` sends."""

    tinker_path: str = Field(pattern=r"^(tinker|twinkle)://", description="tinker://<run_id>/weights/<name>, ...")


Limit = Annotated[int, Query(ge=1, le=10_000)]
Offset = Annotated[int, Query(ge=0)]


router = APIRouter(prefix=PREFIX, route_class=TinkerRoute, tags=["tinker"])


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def _checkpoint(run_id: str, checkpoint: Checkpoint) -> dict[str, Any]:
    path = CheckpointPath.from_store_name(run_id, checkpoint.name)
    expires_at = None if checkpoint.expires_at is None else _time(checkpoint.expires_at)
    return {
        "checkpoint_id": path.checkpoint_id,
        "checkpoint_type": path.kind,
        "time": _time(checkpoint.created_at),
        "tinker_path": path.tinker_path,
        "public": False,
        "expires_at": expires_at,
    }


def _training_run(caller: Caller, run: Run) -> dict[str, Any]:
    saved = caller.state.checkpoints.run_checkpoints(caller.user, run.id) or []
    listed = [_checkpoint(run.id, checkpoint) for checkpoint in saved]
    last = {
        kind: next((c for c in reversed(listed) if c["checkpoint_type"] == kind), None)
        for kind in ("training", "sampler")
    }
    metadata = run.metadata.get("user_metadata") or {}
    return {
        "training_run_id": run.id,
        "base_model": run.metadata.get("base_model") or caller.state.config.model_id,
        "model_owner": caller.user,
        "is_lora": run.lora_config is not None,
        "lora_rank": None if run.lora_config is None else run.lora_config.get("r"),
        "last_request_time": _time(run.created_at),
        "corrupted": False,
        "last_checkpoint": last["training"],
        "last_sampler_checkpoint": last["sampler"],
        "user_metadata": {str(key): str(value) for key, value in metadata.items()} or None,
    }


def _page(total: int, limit: int, offset: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


@router.get("/training_runs", response_model=types.TrainingRunsResponse)
async def list_training_runs(request: Request, limit: Limit = 20, offset: Offset = 0) -> JSONResponse:
    caller = tinker_caller(request)
    runs = list(reversed(caller.state.store.list_runs(caller.user)))  # newest first
    cursor = _page(len(runs), limit, offset)
    return reply(
        {"training_runs": [_training_run(caller, run) for run in runs[offset : offset + limit]], "cursor": cursor}
    )


@router.get("/training_runs/{run_id}", response_model=types.TrainingRun)
async def get_training_run(run_id: str, request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    return reply(_training_run(caller, owned_run(caller, run_id)))


@router.get("/training_runs/{run_id}/checkpoints", response_model=types.CheckpointsListResponse)
async def list_checkpoints(run_id: str, request: Request, limit: Limit = 1000, offset: Offset = 0) -> JSONResponse:
    caller = tinker_caller(request)
    owned_run(caller, run_id)
    saved = caller.state.checkpoints.run_checkpoints(caller.user, run_id) or []
    cursor = _page(len(saved), limit, offset)
    return reply({"checkpoints": [_checkpoint(run_id, c) for c in saved[offset : offset + limit]], "cursor": cursor})


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", response_model=Empty)
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    owned_run(caller, run_id)
    await run_in_threadpool(checkpoints.delete, caller, parse_checkpoint_id(run_id, checkpoint_id))
    return reply({})


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl", response_model=Empty)
async def set_checkpoint_ttl(
    run_id: str, checkpoint_id: str, request: Request, body: Annotated[SetTtl, request_body(SetTtl)]
) -> JSONResponse:
    """``{ttl_seconds}``: the checkpoint expires that many seconds from now; ``null`` keeps it until deleted."""
    caller = tinker_caller(request)
    owned_run(caller, run_id)
    checkpoints.set_ttl(caller, parse_checkpoint_id(run_id, checkpoint_id), body.ttl_seconds)
    return reply({})


@router.post("/weights_info", response_model=types.WeightsInfoResponse)
async def weights_info(request: Request, body: Annotated[WeightsInfo, request_body(WeightsInfo)]) -> JSONResponse:
    caller = tinker_caller(request)
    target = parse_path(body.tinker_path)
    run = caller.state.store.get_run(caller.user, target.run_id)
    if run is None or caller.state.checkpoints.get(caller.user, target.run_id, target.store_name) is None:
        raise ResourceNotFoundError(f"no checkpoint {body.tinker_path!r}")
    return reply(
        {
            "base_model": run.metadata.get("base_model") or caller.state.config.model_id,
            "is_lora": run.lora_config is not None,
            "lora_rank": None if run.lora_config is None else run.lora_config.get("r"),
        }
    )
