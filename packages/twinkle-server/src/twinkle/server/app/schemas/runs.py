"""Runs (a tenant's adapter or model on the server) and their checkpoints."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from twinkle.server.app.schemas.common import Body, Id, Reply, TtlSeconds


class LoraFields(BaseModel):
    """``peft.LoraConfig`` arguments; the common ones are typed here, any other LoraConfig field is passed on."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, JsonValue] = Field(init=False)

    r: Annotated[int, Field(ge=1)] = 8
    lora_alpha: Annotated[float, Field(gt=0)] | None = None
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] | None = None
    target_modules: str | list[str] | None = None


class CreateRun(Body):
    """A run in an open session: a LoRA adapter on the base model, or (``lora_config`` null) every weight."""

    session_id: Id
    lora_config: LoraFields | None = None
    base_model: Annotated[
        str | None, Field(min_length=1, description="A twinkle:// checkpoint of the caller's to start from")
    ] = None
    gradient_accumulation_steps: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None  # what torch.manual_seed takes

    def lora_dict(self) -> dict[str, JsonValue] | None:
        """The LoRA arguments as sent (defaults not filled in: the model's own defaults apply)."""
        return None if self.lora_config is None else self.lora_config.model_dump(exclude_unset=True)


class RunCreated(Reply):
    run_id: str


class ResumeRun(Body):
    session_id: Id


class CheckpointListing(Reply):
    name: str
    path: str = Field(description="twinkle://<run_id>/<name>: what load and base_model take")
    created_at: float
    expires_at: float | None = Field(description="Epoch seconds when it is deleted; null: kept until deleted")


class CheckpointList(Reply):
    checkpoints: list[CheckpointListing]


class RunListing(Reply):
    run_id: str
    user: str
    lora_config: dict[str, JsonValue] | None
    base_model: str | None
    created_at: float
    resident: bool = Field(description="Whether its weights are loaded (its session is open)")
    checkpoints: list[CheckpointListing]


class RunList(Reply):
    runs: list[RunListing]


class SetTtl(Body):
    ttl_seconds: TtlSeconds = Field(description="Seconds from now until deletion; null keeps it until deleted")
