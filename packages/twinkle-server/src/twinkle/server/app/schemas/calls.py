"""``POST /runs/{run_id}/call``: one in-process API method of the run's model, with its typed arguments.

The body is ``{"method": ..., "kwargs": {...}, "idempotency_key": ...}``; ``method`` picks the arguments'
model, so a wrong argument is refused naming the method and the field. Long methods answer with a future,
short ones with their result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, JsonValue, RootModel, create_model, model_validator

from twinkle.model import check_loss_inputs
from twinkle.server.app.schemas.common import (
    AnyResult,
    Array,
    Body,
    CheckpointName,
    FutureCreated,
    IdempotencyKey,
    Inputs,
    RegisteredName,
    Reply,
    TtlSeconds,
)
from twinkle.server.paths import SAMPLER_WEIGHTS_DIR

# The server decides these; a tenant sending one would reach another tenant's adapter or the server's files.
SERVER_ARGUMENTS = ("adapter_name", "output_dir", "dataloader")


class Arguments(BaseModel):
    """A method's keyword arguments; ``arguments()`` is what the model's method is called with."""

    model_config = ConfigDict(extra="forbid")

    def arguments(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in type(self).model_fields} | dict(self.__pydantic_extra__ or {})


class OpenArguments(Arguments):
    """Arguments that also take keywords of their own (a component's options, a loss's inputs), except those
    the server decides."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _no_server_arguments(cls, data: Any) -> Any:
        for name in data if isinstance(data, Mapping) else ():
            if name in SERVER_ARGUMENTS:
                raise ValueError(f"{name!r} cannot be set remotely; the server decides it")
        return data


class WithOptions(OpenArguments):
    """A component's name and its constructor options (plain JSON values)."""

    __pydantic_extra__: dict[str, JsonValue] = Field(init=False)


class SetOptimizer(WithOptions):
    optimizer_cls: RegisteredName = "AdamW"


class SetLrScheduler(WithOptions):
    scheduler_cls: RegisteredName


class SetLoss(WithOptions):
    loss: RegisteredName


class SetTemplate(WithOptions):
    template: RegisteredName


class SetProcessor(WithOptions):
    processor: RegisteredName


class UpdateOptimizer(WithOptions):
    """Hyper-parameters the optimizer's param groups already have (``lr``, ``betas``, ...)."""


class CalculateMetric(Arguments):
    is_training: bool = True


class LossInputs(OpenArguments):
    """Inputs of the run's loss (``advantages``, ``old_logps``, ``ref_logps``, ...): one entry per sample, or shared."""

    __pydantic_extra__: dict[str, Array] = Field(init=False)
    counted: ClassVar[bool] = False  # whether per-sample loss inputs must match ``inputs``

    @model_validator(mode="after")
    def _loss_inputs_fit(self) -> LossInputs:
        extra = self.__pydantic_extra__ or {}
        inputs = getattr(self, "inputs", None)
        if self.counted and inputs is not None:
            check_loss_inputs(extra, 1 if isinstance(inputs, Mapping) else len(inputs))
        return self


class Forward(Arguments):
    inputs: Inputs


class ForwardOnly(LossInputs):
    inputs: Inputs
    return_logits: bool = False


class ForwardBackward(LossInputs):
    inputs: Inputs
    micro_batch_size: Annotated[int, Field(ge=1)] | None = None
    counted: ClassVar[bool] = True


class CalculateLoss(LossInputs):
    pass


class ClipGradNorm(Arguments):
    max_grad_norm: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0


class Save(Arguments):
    name: CheckpointName
    save_optimizer: bool = True
    ttl_seconds: TtlSeconds = None

    @model_validator(mode="after")
    def _not_reserved(self) -> Save:
        if self.name == SAMPLER_WEIGHTS_DIR:
            raise ValueError(f"the checkpoint name {self.name!r} is reserved for sampler weights saved over Tinker")
        return self


class Load(Arguments):
    path: Annotated[str, Field(min_length=1, description="A checkpoint: twinkle://<run_id>/<name>, or a name")]
    load_optimizer: bool = False


class NoArguments(Arguments):
    """No arguments."""


ARGUMENTS: dict[str, type[Arguments]] = {
    "set_optimizer": SetOptimizer,
    "set_lr_scheduler": SetLrScheduler,
    "set_loss": SetLoss,
    "set_template": SetTemplate,
    "set_processor": SetProcessor,
    "update_optimizer": UpdateOptimizer,
    "zero_grad": NoArguments,
    "lr_step": NoArguments,
    "calculate_metric": CalculateMetric,
    "forward": Forward,
    "forward_only": ForwardOnly,
    "calculate_loss": CalculateLoss,
    "backward": NoArguments,
    "forward_backward": ForwardBackward,
    "step": NoArguments,
    "clip_grad_norm": ClipGradNorm,
    "clip_grad_and_step": ClipGradNorm,
    "save": Save,
    "load": Load,
}


def _call_model(method: str, arguments: type[Arguments]) -> type[Body]:
    """``{"method": <method>, "kwargs": <arguments>, "idempotency_key": ...}`` as a model of its own."""
    required = any(field.is_required() for field in arguments.model_fields.values())
    fields: dict[str, Any] = {
        "method": (Literal[method], ...),
        "kwargs": (arguments, ...) if required else (arguments, Field(default_factory=arguments)),
        "idempotency_key": (IdempotencyKey | None, None),
    }
    name = "Call" + "".join(part.title() for part in method.split("_"))
    return create_model(name, __base__=Body, __module__=__name__, **fields)


CALLS: dict[str, type[Body]] = {method: _call_model(method, arguments) for method, arguments in ARGUMENTS.items()}
_ANY_CALL: Any = Annotated[Union[tuple(CALLS.values())], Discriminator("method")]  # noqa: UP007  # one per method


class CallRequest(RootModel[Any]):
    """A call of one of the run's methods: ``method`` selects the model of ``kwargs``."""

    root: _ANY_CALL  # a union built from CALLS (Any to mypy)

    tagged: ClassVar[bool] = True  # errors are located under the method's name first; the client sent no such level

    @model_validator(mode="before")
    @classmethod
    def _known_method(cls, data: Any) -> Any:
        method = data.get("method") if isinstance(data, Mapping) else None
        if not isinstance(method, str) or method not in CALLS:
            raise ValueError(f"unknown method {method!r}; callable: {sorted(CALLS)}")
        return data

    @property
    def method(self) -> str:
        return str(self.root.method)

    @property
    def idempotency_key(self) -> str | None:
        return self.root.idempotency_key

    def arguments(self) -> dict[str, Any]:
        return self.root.kwargs.arguments()


class CallResult(Reply):
    """A short method's return value (``set_*``, ``zero_grad``, ``calculate_metric``, ...)."""

    result: AnyResult


CallReply = CallResult | FutureCreated
