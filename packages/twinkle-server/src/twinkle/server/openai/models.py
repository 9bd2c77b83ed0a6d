"""What ``model`` may name: the served base model, one of the caller's loaded runs, or one of the caller's
checkpoints (``twinkle://<run>/<name>``); anyone else's is unknown (404), as if it did not exist.

A run samples with its current weights, synced from training first, and queues behind its own training
calls; a LoRA checkpoint is loaded into the sampler once, under a name of its own, and dropped from it
when the checkpoint is deleted or expires.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle.data_format import SamplingParams
from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.app.calls import CHECKPOINT_SCHEME, checkpoint_reference
from twinkle.server.app.state import ServerState
from twinkle.server.services.batches import SampleRequest
from twinkle.server.services.checkpoints import CheckpointHold
from twinkle.server.store.base import Checkpoint

OWNER = "twinkle"  # ``owned_by`` of the base model; runs and checkpoints are owned by their user


@dataclass(frozen=True)
class SamplingTarget:
    """The weights a request samples with (a :class:`SampleRequest` without its prompts and parameters)."""

    queue_key: str  # the engine queue: the run's own, or a queue of the request's own
    weights: SampleRequest
    hold: CheckpointHold | None = None  # a checkpoint's files, kept until the request is over
    adapter: str | None = None  # a checkpoint's sampler adapter (dropped when the checkpoint is removed)

    def request(self, inputs: list[dict[str, Any]], params: SamplingParams) -> SampleRequest:
        return dataclasses.replace(self.weights, inputs=inputs, params=params)

    def release(self) -> None:
        if self.hold is not None:
            self.hold.release()


def base_model_names(state: ServerState) -> tuple[str, str]:
    """The served model by its configured id, or by its local folder."""
    return state.config.model_id, state.engine.model_path


def resolve(state: ServerState, user: str, model: str) -> SamplingTarget:
    """The caller's weights that ``model`` names; :class:`ResourceNotFoundError` for anything else."""
    queue_key = f"openai:{user}"  # the user's concurrent requests batch together (scheduler.py)
    if model in base_model_names(state):
        return SamplingTarget(queue_key, SampleRequest(None, None))
    if model.startswith(CHECKPOINT_SCHEME):
        return _checkpoint_target(state, user, model, queue_key)
    run = state.store.get_run(user, model)
    if run is None:
        raise _unknown(model)
    if not run.resident:
        raise ResourceNotFoundError(
            f"the model {model!r} is not loaded (its session ended); sample one of its checkpoints "
            f"({CHECKPOINT_SCHEME}{model}/<name>) or resume the run"
        )
    return SamplingTarget(run.id, SampleRequest(None, None, run_id=run.id, template={}))


def list_models(state: ServerState, user: str) -> list[dict[str, Any]]:
    """The base model, then the caller's loaded runs and live checkpoints, oldest first."""
    models = [{"id": state.config.model_id, "created": 0, "owned_by": OWNER}]
    for run in state.store.list_runs(user):
        if run.resident:
            models.append({"id": run.id, "created": int(run.created_at), "owned_by": user})
        for checkpoint in state.checkpoints.run_checkpoints(user, run.id) or []:
            reference = checkpoint_reference(run.id, checkpoint.name)
            models.append({"id": reference, "created": int(checkpoint.created_at), "owned_by": user})
    return models


def find_model(state: ServerState, user: str, model: str) -> dict[str, Any]:
    if model in base_model_names(state):  # either of its names
        return {"id": model, "created": 0, "owned_by": OWNER}
    for listing in list_models(state, user):
        if listing["id"] == model:
            return listing
    raise _unknown(model)


def checkpoint_adapter(user: str, checkpoint: Checkpoint) -> str:
    """The sampler adapter serving a checkpoint; a checkpoint saved again under the same name gets a new one."""
    return f"openai:{user}:{checkpoint.run_id}/{checkpoint.name}@{checkpoint.created_at!r}"


def _checkpoint_target(state: ServerState, user: str, model: str, queue_key: str) -> SamplingTarget:
    run_id, _, name = model.removeprefix(CHECKPOINT_SCHEME).partition("/")
    run = state.store.get_run(user, run_id) if run_id and name else None
    checkpoint = None if run is None else state.checkpoints.get(user, run_id, name)
    if run is None or checkpoint is None:
        raise _unknown(model)
    hold = state.checkpoints.hold(user, run_id, name, shown=model)
    try:
        directory = Path(hold.path)
        if (directory / "adapter_config.json").is_file():
            if run.base_model is not None:
                raise InvalidInputError(
                    f"{model!r} is a LoRA adapter on the run's own base model {run.base_model!r}; only adapters "
                    "on the served base model can be sampled here"
                )
            adapter = checkpoint_adapter(user, checkpoint)
            weights = SampleRequest(None, None, adapter_name=adapter, checkpoint=str(directory), keep_loaded=True)
            return SamplingTarget(queue_key, weights, hold, adapter)
        if (directory / "config.json").is_file():  # a full-parameter checkpoint: a model of its own
            return SamplingTarget(queue_key, SampleRequest(None, None, base_path=str(directory), template={}), hold)
        raise InvalidInputError(f"{model!r} holds no model weights that can be sampled (an optimizer state only?)")
    except BaseException:
        hold.release()
        raise


def _unknown(model: str) -> ResourceNotFoundError:
    return ResourceNotFoundError(f"The model {model!r} does not exist or you do not have access to it.")
