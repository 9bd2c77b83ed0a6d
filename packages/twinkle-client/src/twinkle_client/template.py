"""``Template`` over HTTP: chat-template encoding and decoding done by the server's tokenizer.

A remote client has no tokenizer (no transformers); the server has the base
model's. Each call sends the template's constructor arguments along, so the
object is as cheap to create as a name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twinkle.data_format import InputFeature, Trajectory
from twinkle_client.components import component_spec
from twinkle_client.context import get_client
from twinkle_client.images import images_by_value


class Template:
    """Remote twin of ``twinkle.template.Template`` (same constructor arguments, minus a local ``tokenizer``)."""

    def __init__(
        self,
        model_id: str | None = None,
        max_length: int | None = 8192,
        truncation_strategy: str = "raise",
        default_system: str | None = None,
        enable_thinking: bool = True,
        chat_template: str | None = None,
    ) -> None:
        self.model_id = model_id
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        self.default_system = default_system
        self.enable_thinking = enable_thinking
        self.chat_template = chat_template

    @property
    def spec(self) -> dict[str, Any]:
        """How the server builds this template: ``{"name": "Template", "kwargs": {...}}``."""
        name, kwargs = component_spec(self, "Template")
        return {"name": name, "kwargs": kwargs}

    def encode(self, trajectory: Trajectory, add_generation_prompt: bool = False) -> InputFeature | None:
        """One trajectory to an ``InputFeature`` (``None`` when too long under ``truncation_strategy='delete'``)."""
        return self.batch_encode([trajectory], add_generation_prompt)[0]

    def batch_encode(
        self, trajectories: Sequence[Trajectory], add_generation_prompt: bool = False
    ) -> list[InputFeature | None]:
        body = {
            "template": self.spec,
            "trajectories": images_by_value(list(trajectories)),  # images as data URIs
            "add_generation_prompt": add_generation_prompt,
        }
        return get_client().request("POST", "/templates/encode", body)["features"]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.batch_decode([token_ids], skip_special_tokens)[0]

    def batch_decode(self, batch_token_ids: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        body = {
            "template": self.spec,
            "token_ids": [list(ids) for ids in batch_token_ids],
            "skip_special_tokens": skip_special_tokens,
        }
        return get_client().request("POST", "/templates/decode", body)["texts"]
