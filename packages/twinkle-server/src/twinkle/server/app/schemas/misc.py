"""Server info, sessions, futures, sampling, templates and server-side data."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, JsonValue, PlainValidator, ValidationInfo

from twinkle.data_format import InputFeature, SamplingParams, Trajectory, validate_trajectory
from twinkle.errors import InvalidInputError
from twinkle.server.app.schemas.common import (
    AnyResult,
    Body,
    ComponentSpec,
    ErrorDetail,
    Id,
    IdempotencyKey,
    Inputs,
    Reply,
)


class Health(Reply):
    status: Literal["ok"]


class Replica(Reply):
    index: int
    replica_id: str | None = None
    pid: int | None
    alive: bool
    runs: list[str]
    adapters: list[str] | None = Field(description="null when the replica could not be asked")


class Replicas(Reply):
    replicas: list[Replica]


class ServerInfo(Reply):
    base_model: str | None
    max_rank: int
    max_loras: int
    version: str


class SessionCreated(Reply):
    session_id: str


class FutureReply(Reply):
    """A long call's state; ``result`` once it is done, ``error`` if it failed."""

    status: Literal["pending", "done", "failed"]
    result: AnyResult = None
    error: ErrorDetail | None = None


class Sample(Body):
    """Sample with a run's current weights (``run_id``), a ``base_model`` checkpoint, or the server's model."""

    run_id: Id | None = None
    base_model: Annotated[str | None, Field(min_length=1, description="A twinkle:// checkpoint of the caller's")] = None
    inputs: Inputs
    sampling_params: SamplingParams | None = None
    num_samples: Annotated[int, Field(ge=1, le=1024)] | None = None
    template: ComponentSpec | None = None
    idempotency_key: IdempotencyKey | None = None


def _trajectories(value: Any) -> Any:
    if not isinstance(value, list):
        raise InvalidInputError(f"trajectories must be a list of {{'messages': [...]}} objects, got {value!r:.80}")
    return [validate_trajectory(item, f"trajectories[{index}]") for index, item in enumerate(value)]


class Encode(Body):
    """Encode trajectories with a registered template of the server's model (the client needs no tokenizer)."""

    trajectories: Annotated[list[Any], PlainValidator(_trajectories, json_schema_input_type=list[Trajectory])]
    template: ComponentSpec | None = None
    add_generation_prompt: bool = False


class Features(Reply):
    features: list[InputFeature]


def _in_vocabulary(token_ids: list[list[int]], info: ValidationInfo) -> list[list[int]]:
    vocab_size = (info.context or {}).get("vocab_size")
    for row, ids in enumerate(token_ids):
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise InvalidInputError(f"token_ids[{row}] has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return token_ids


class Decode(Body):
    token_ids: Annotated[list[list[int]], AfterValidator(_in_vocabulary)]
    template: ComponentSpec | None = None
    skip_special_tokens: bool = False


class Texts(Reply):
    texts: list[str]


class DatasetStep(Body):
    """One step applied to the dataset; component arguments (``template``, ``preprocessor``, ``predicate``) are
    ``{"name": <registered name>, "kwargs": {...}}``."""

    op: Literal["set_template", "map", "encode", "filter", "shuffle", "select"]
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)


class DataSlice(Body):
    start: int | None = None
    stop: int | None = None
    step: Annotated[int, Field(ge=1)] | None = None


class CreateDataset(Body):
    dataset_id: str = Field(description="A hub id: builtin://..., hf://... or ms://... (never a server path)")
    split: str | None = None
    subset_name: str | None = None
    data_slice: DataSlice | list[Annotated[int, Field(ge=0)]] | None = None
    steps: list[DatasetStep] = Field(default_factory=list)


class CreateDataloader(Body):
    dataset: Id = Field(description="A dataset handle from POST /datasets")
    batch_size: Annotated[int, Field(ge=1)]
    min_batch_size: Annotated[int, Field(ge=1)] | None = None
    shuffle: bool = False
    seed: int = 42
    drop_last: bool = False


class DataHandle(Reply):
    handle: str
    length: int


class NextBatch(Reply):
    """The next batch, or ``end`` once the epoch is over (the next request starts a new one)."""

    batch: list[JsonValue] | None = Field(default=None, description="Encoded features, or rows if not encoded")
    end: bool | None = None
