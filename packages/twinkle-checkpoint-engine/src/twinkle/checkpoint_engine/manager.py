"""``CheckpointEngineManager``: keep a sampler on the trainer's current weights, in one process.

RL alternates sampling and training; before each round the sampler must hold
the policy being trained. With LoRA only the adapter changes, so only the
adapter moves (a few MB instead of the model); ``merge_and_sync=True`` instead
pushes every base weight with the adapter merged in, for samplers that serve
the policy as a plain model. Tensors are handed over as they are — the
sampler copies them onto its own device — with no serialisation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from twinkle.checkpoint_engine.weights import lora_payload, merged_weights
from twinkle.errors import ConfigurationError
from twinkle.registry import register
from twinkle.utils import get_logger

logger = get_logger(__name__)


class WeightReceiver(Protocol):
    """What a sampler offers to receive weights (``twinkle.sampler.TorchSampler`` implements all of it).

    ``add_adapter`` replaces an adapter of the same name with a copy of the
    given PEFT-format tensors (LoRA sync); ``load_base_weights`` copies named
    tensors (the base model's ``state_dict`` names), streamed one at a time,
    into the base model, after which ``reset_prefix_cache`` drops anything
    cached under the old weights (merged sync). A sampler needs only the
    methods of the mode it is synced with.
    """

    def add_adapter(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None: ...

    def load_base_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def reset_prefix_cache(self) -> None: ...


@runtime_checkable
class WeightSource(Protocol):
    """A trainer that hands out its own weights (``twinkle.model.MultiLoraModel`` does).

    Trainers without these methods are read through PEFT (``model.model``, a ``PeftModel``).
    """

    def lora_payload(self, adapter_name: str) -> tuple[Any, Mapping[str, torch.Tensor]]: ...

    def merged_weights(self, adapter_name: str | None) -> Iterable[tuple[str, torch.Tensor]]: ...


@register("checkpoint_engine")
class CheckpointEngineManager:
    """Syncs ``model`` (a ``TransformersModel`` or a :class:`WeightSource` with ``.adapter_names``) into ``sampler``.

    ``adapter_name`` defaults to the model's only adapter; the sampler serves
    it under the same name, so sample with ``adapter_name=<that name>`` after
    a LoRA sync. A model without adapters (full-parameter training) can only
    be synced with ``merge_and_sync=True``.
    """

    def __init__(self, model: Any, sampler: WeightReceiver, adapter_name: str | None = None) -> None:
        names = list(model.adapter_names)
        if adapter_name is not None and adapter_name not in names:
            raise ConfigurationError(f"the model has no adapter {adapter_name!r}; adapters: {names}")
        if adapter_name is None and len(names) > 1:
            raise ConfigurationError(f"the model has several adapters {names}: pass adapter_name=")
        self.model = model
        self.sampler = sampler
        self.adapter_name = adapter_name if adapter_name is not None else (names[0] if names else None)

    def sync_weights(self, merge_and_sync: bool = False) -> None:
        """Push the trainer's current weights into the sampler (see the module docstring)."""
        source = self.model if isinstance(self.model, WeightSource) else None
        if merge_and_sync:
            self._require("load_base_weights", "merged weights")
            name = self.adapter_name
            weights = source.merged_weights(name) if source else merged_weights(self.model.model, name)
            count = self.sampler.load_base_weights(weights)
            self.sampler.reset_prefix_cache()
            logger.debug("synced %d merged base weights", count)
            return
        if self.adapter_name is None:
            raise ConfigurationError(
                "the model has no LoRA adapter to sync; use sync_weights(merge_and_sync=True) to push all weights"
            )
        self._require("add_adapter", "LoRA adapters")
        config, tensors = (
            source.lora_payload(self.adapter_name) if source else lora_payload(self.model.model, self.adapter_name)
        )
        self.sampler.add_adapter(self.adapter_name, config, tensors)
        logger.debug("synced adapter %r: %d tensors", self.adapter_name, len(tensors))

    def _require(self, method: str, what: str) -> None:
        if not callable(getattr(self.sampler, method, None)):
            raise ConfigurationError(f"{type(self.sampler).__name__} cannot receive {what}: it has no {method}()")
