"""Types every native body uses: names a tenant may send, batches of features, arrays, errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, JsonValue, PlainValidator, ValidationInfo, WithJsonSchema

from twinkle.data_format import FREE_EXPERT, InputFeature, Trajectory, validate_input_feature, validate_trajectory
from twinkle.errors import InvalidInputError
from twinkle.server.paths import check_name
from twinkle.server.services.components import REGISTERED_NAME, check_component_name
from twinkle.server.store import check_ttl_seconds
from twinkle.server.store.base import MAX_TTL_S


class Body(BaseModel):
    """A request or reply body: unknown fields are refused, so a typo is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid")


class Reply(BaseModel):
    """A reply body: clients ignore fields they do not know, which later versions may add."""


class Empty(Body):
    """No fields."""


def _registered_name(name: Any, info: ValidationInfo) -> str:
    return check_component_name(name, info.field_name or "name")


# A component is named by its registry name, never by an import path (that would run any code on the server).
RegisteredName = Annotated[
    str,
    PlainValidator(_registered_name, json_schema_input_type=str),
    WithJsonSchema({"type": "string", "pattern": REGISTERED_NAME, "description": "A registered component's name"}),
]
Id = Annotated[str, Field(min_length=1, max_length=200)]
IdempotencyKey = Annotated[
    str, Field(min_length=1, max_length=200, description="Repeat it to get the first request's future back")
]


CheckpointName = Annotated[
    str,
    PlainValidator(check_name, json_schema_input_type=str),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 255, "pattern": r"^[^./\\\x00][^/\\\x00]*$"}),
]
TtlSeconds = Annotated[
    float | None,
    PlainValidator(check_ttl_seconds),  # the store's own rule
    WithJsonSchema(
        {
            "anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TTL_S}, {"type": "null"}],
            "description": "Seconds until the checkpoint is deleted; null keeps it until deleted",
        }
    ),
]


class ComponentSpec(Body):
    """A registered component and its options, e.g. ``{"name": "Template", "kwargs": {}}``."""

    name: RegisteredName = "Template"
    kwargs: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


def spec_dict(spec: ComponentSpec | None) -> dict[str, Any] | None:
    """What the services take for an optional component (``None``: their default)."""
    return None if spec is None else spec.model_dump()


def _array(value: Any) -> Any:
    """A number, a (nested) list of numbers, a numeric array of the wire codec, or None (as in-process)."""
    if value is None:
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise InvalidInputError(f"expected a numeric array, got dtype {value.dtype}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        raise InvalidInputError(f"expected a number or a list of numbers, got {type(value).__name__}")
    return value


_NESTED_NUMBERS = {"anyOf": [{"type": "number"}, {"type": "array", "items": {}}, {"type": "null"}]}
# Loss inputs (advantages, old log-probs, ...): per sample, per token, or one value.
Array = Annotated[Any, PlainValidator(_array), WithJsonSchema(_NESTED_NUMBERS)]


def _inputs(value: Any, info: ValidationInfo) -> Any:
    """A feature, a trajectory, or a list of either; features are checked against the model's vocabulary and
    context here, trajectories once the template has encoded them."""
    context = info.context or {}
    items = [value] if isinstance(value, Mapping) else value
    if not isinstance(items, list) or not items:
        raise InvalidInputError(
            f"inputs must be a feature, a trajectory or a non-empty list of them, got {value!r:.80}"
        )
    for index, item in enumerate(items):
        where = f"inputs[{index}]"
        if isinstance(item, Mapping) and "input_ids" in item:
            feature = validate_input_feature(item, where=where, vocab_size=context.get("vocab_size"))
            limit = context.get("max_length")
            if limit is not None and len(feature["input_ids"]) > limit:
                raise InvalidInputError(
                    f"{where} has {len(feature['input_ids'])} tokens; the model's context is {limit}"
                )
            if feature.get("routed_experts") is not None and "routing" in context:
                _check_routing(feature["routed_experts"], context["routing"], f"{where}.routed_experts")
        else:
            validate_trajectory(item, where=where)
    return value


def _check_routing(record: list[list[list[int]]], routing: tuple[int, int, int] | None, where: str) -> None:
    """A (well-formed) routing record fits the served model's MoE routing ``(layers, top_k, experts)``: checked
    here, so that one tenant's bad record is refused before it could fail a pass shared with others."""
    if routing is None:
        raise InvalidInputError(f"{where} was given, but the server's model has no MoE router to replay it on")
    layers, top_k, experts = routing
    found = (len(record[0]), len(record[0][0]) if record[0] else 0)
    if found != (layers, top_k):
        raise InvalidInputError(
            f"{where} records {found[0]} layer(s) x top-{found[1]}; the server's model has {layers} MoE layer(s) "
            f"x top-{top_k}"
        )
    highest = max(expert for chosen in record for layer in chosen for expert in layer)
    if highest >= experts:
        raise InvalidInputError(
            f"{where} holds expert id {highest}; the server's model has {experts} experts (ids 0..{experts - 1}, "
            f"{FREE_EXPERT}: route freely)"
        )


Inputs = Annotated[
    Any,
    PlainValidator(
        _inputs,
        # The lists non-empty, as ``_inputs`` requires.
        json_schema_input_type=InputFeature
        | Annotated[list[InputFeature], Field(min_length=1)]
        | Trajectory
        | Annotated[list[Trajectory], Field(min_length=1)],
    ),
]


class ErrorDetail(BaseModel):
    """What went wrong: ``type`` is the ``twinkle.errors`` class the client raises."""

    type: str = Field(description="The error's class in twinkle.errors, e.g. InvalidInputError")
    message: str
    field: str | None = Field(default=None, description="The body field at fault (dotted), when one is")
    limit: str | None = Field(default=None, description="The quota that was hit (QuotaExceededError)")


class ErrorReply(BaseModel):
    """Every native error reply (and a failed future's ``error``)."""

    error: ErrorDetail


class FutureCreated(Reply):
    future_id: str


AnyResult = JsonValue  # a call's result: its in-process return value as plain data (arrays as lists)
