"""The HTTP contract shared by every API: typed request bodies, read and validated once at the edge, and
what ``/openapi.json`` says about them.

A route declares its body as a parameter, ``body: Annotated[CreateRun, request_body(CreateRun)]``. The body is read
in either codec the server speaks (JSON, or the binary wire codec of :mod:`twinkle.wire`, chosen by
``Content-Type``) and validated into the model, with the server's limits (vocabulary, context) in the
validation context; a mismatch is an :class:`~twinkle.errors.InvalidInputError` naming the field. Below
the route, services take the typed values and do not check them again.

Routers built with :class:`ContractRoute` document that body (both media types) in the operation, and
:func:`install_openapi` adds the request models to ``components/schemas`` next to the response models
FastAPI already lists.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from twinkle import wire
from twinkle.errors import InvalidInputError
from twinkle.server.app.http import caller, read_body

ModelT = TypeVar("ModelT", bound=BaseModel)
REF_TEMPLATE = "#/components/schemas/{model}"
_REQUEST_MODEL = "__twinkle_request_model__"  # the model a body dependency parses, read by ContractRoute
_WIRE_REPLIES = "x-wire-replies"  # marks an operation for install_openapi, which removes the mark


def validation_context(request: Request) -> dict[str, Any]:
    """What bodies are checked against: the served model's vocabulary, context length and MoE routing."""
    engine = request.app.state.server.engine
    return {"vocab_size": engine.vocab_size, "max_length": engine.max_length, "routing": engine.routing}


def validate(model: type[ModelT], body: Any, context: Mapping[str, Any] | None = None) -> ModelT:
    """``body`` as ``model``; a mismatch is the caller's :class:`InvalidInputError` naming the first bad field."""
    try:
        return model.model_validate(body, context=dict(context or {}))
    except ValidationError as exc:
        raise _invalid_input(model, exc) from None


def _invalid_input(model: type[BaseModel], exc: ValidationError) -> InvalidInputError:
    """One error for all of a body's problems; ``field`` is the first one's dotted location."""
    problems, fields = [], []
    for error in exc.errors(include_url=False):
        parts = error["loc"][1:] if getattr(model, "tagged", False) else error["loc"]  # no tag level on the wire
        location = ".".join(str(part) for part in parts)
        fields.append(location or None)
        # Our own validators' messages already name the field (e.g. "inputs[0].input_ids[0] must be an int").
        own = error.get("ctx", {}).get("error") if error["type"] == "value_error" else None
        problems.append(str(own) if own is not None else f"{location or 'body'}: {error['msg']}")
    invalid = InvalidInputError(f"invalid {model.__name__}: {'; '.join(problems)}")
    invalid.field = fields[0] if fields else None  # type: ignore[attr-defined]  # reported as error.field
    return invalid


def request_body(model: type[ModelT]) -> Any:
    """A route parameter: the request's body as ``model``, read after the caller is authenticated."""

    async def parse(request: Request) -> ModelT:
        caller(request)  # who asks comes first: strangers learn nothing about bodies
        return validate(model, await read_body(request), validation_context(request))

    setattr(parse, _REQUEST_MODEL, model)
    return Depends(parse)


class ContractRoute(APIRoute):
    """An operation documenting its typed request body (JSON or wire codec) and its error replies.

    Subclasses name the API's error body (``error_model``) and whether replies also come in the wire codec.
    """

    error_model: type[BaseModel] | None = None
    wire_replies = False
    request_models: ClassVar[dict[str, type[BaseModel]]] = {}  # every route's, for install_openapi

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if self.error_model is not None:
            errors = {status: {"model": self.error_model, "description": text} for status, text in ERRORS.items()}
            kwargs["responses"] = {**errors, **(kwargs.get("responses") or {})}
        super().__init__(path, endpoint, **kwargs)
        self.request_model: type[BaseModel] | None = next(
            (getattr(d.call, _REQUEST_MODEL) for d in self.dependant.dependencies if hasattr(d.call, _REQUEST_MODEL)),
            None,
        )
        if self.request_model is not None:
            media = {"schema": {"$ref": REF_TEMPLATE.format(model=self.request_model.__name__)}}
            content = {"application/json": media, wire.CONTENT_TYPE: media}
            required = any(field.is_required() for field in self.request_model.model_fields.values())
            self.openapi_extra = {
                **(self.openapi_extra or {}),
                "requestBody": {"required": required, "content": content},
            }
            ContractRoute.request_models[self.request_model.__name__] = self.request_model
        if self.wire_replies:
            self.openapi_extra = {**(self.openapi_extra or {}), _WIRE_REPLIES: True}


ERRORS = {
    400: "The request names something invalid (the message and `field` say what)",
    401: "No API key, or an unknown one",
    403: "Not allowed, or over a quota (`limit` names it)",
    404: "No such resource of the caller's",
    409: "The resource is not in a state that allows this call",
    422: "The body is not JSON or wire-codec data, or a path or query parameter has the wrong type",
    429: "Too many requests (`limit` names the rate)",
    500: "A server fault (reported, never the caller's data)",
}


def install_openapi(app: FastAPI, description: str) -> None:
    """``app.openapi()`` also lists the request models (FastAPI knows only the response models) and the wire
    codec as a second media type of every reply that can come in it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schema["info"]["description"] = description
            models = ContractRoute.request_models.values()
            _, defs = models_json_schema([(model, "validation") for model in models], ref_template=REF_TEMPLATE)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                if _open(components.setdefault(name, definition)) != _open(definition):
                    raise TypeError(f"two different schemas are both called {name!r}; rename one model")
            for operations in schema["paths"].values():
                for operation in operations.values():
                    if operation.pop(_WIRE_REPLIES, False):
                        _add_wire_replies(operation)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema


def _open(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without ``additionalProperties: true``, JSON Schema's default that pydantic spells out in
    validation mode only."""
    return {key: value for key, value in schema.items() if (key, value) != ("additionalProperties", True)}


def _add_wire_replies(operation: dict[str, Any]) -> None:
    for reply in operation.get("responses", {}).values():
        content = reply.get("content", {})
        if "application/json" in content:
            content[wire.CONTENT_TYPE] = content["application/json"]
