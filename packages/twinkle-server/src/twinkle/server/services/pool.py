"""The base model hosted once: a ``MultiLoraModel`` for training every tenant, a sampler for generation.

Only the scheduler's worker thread calls into the pool, so the model never
sees two calls at once. Each run (a tenant's training run) is one adapter,
named by its run id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from peft import LoraConfig

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model import AdapterRequest, AdapterResult, MultiLoraModel
from twinkle.module import adapter_names
from twinkle.registry import build
from twinkle.sampler import TorchSampler

# The in-process API a tenant may call on its run, by how long it takes (short ones are answered directly).
SHORT_METHODS = frozenset(
    {"set_optimizer", "set_lr_scheduler", "set_loss", "set_template", "set_processor", "zero_grad", "lr_step",
     "calculate_metric"}
)  # fmt: skip
LONG_METHODS = frozenset(
    {"forward", "forward_only", "calculate_loss", "backward", "forward_backward", "step", "clip_grad_norm",
     "clip_grad_and_step", "save", "load"}
)  # fmt: skip


class ModelPool:
    """Adapters of every resident run on one base model, plus sampling with any of them."""

    def __init__(self, model_id: str | None, max_loras: int, max_rank: int, device: str | None = None) -> None:
        self.model = MultiLoraModel(model_id, max_loras=max_loras, max_rank=max_rank, device=device)
        self.model_path = self.model.model_path
        self.sampler = TorchSampler(model_id=self.model_path, device=device)
        self.sampler.set_template("Template", model_id=self.model_path)
        self._templates: dict[str, Any] = {}

    @property
    def max_loras(self) -> int:
        return self.model.max_loras

    @property
    def max_rank(self) -> int:
        return self.model.max_rank

    def resident(self, run_id: str) -> bool:
        return run_id in self.model.adapter_names

    def add_run(
        self, run_id: str, lora_config: Mapping[str, Any], gradient_accumulation_steps: int = 1, seed: int | None = None
    ) -> None:
        if not isinstance(lora_config, Mapping):
            raise InvalidInputError(
                f"lora_config must be an object of LoraConfig fields, got {type(lora_config).__name__}"
            )
        try:
            config = LoraConfig(**lora_config)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"invalid lora_config {dict(lora_config)}: {exc}") from exc
        self.model.add_adapter_to_model(run_id, config, gradient_accumulation_steps, seed=seed)

    def remove_run(self, run_id: str) -> None:
        """Free the run's adapter, optimizer and gradients; its checkpoints stay on disk."""
        if self.resident(run_id):
            self.model.remove_adapter(run_id)
        if run_id in self.sampler_adapters():
            self.sampler.remove_adapter(run_id)

    def sampler_adapters(self) -> list[str]:
        return adapter_names(self.sampler.model)

    def call(self, run_id: str, method: str, kwargs: Mapping[str, Any]) -> Any:
        """Run one in-process API method on the run's adapter."""
        if method not in SHORT_METHODS | LONG_METHODS:
            raise InvalidInputError(f"unknown method {method!r}; callable: {sorted(SHORT_METHODS | LONG_METHODS)}")
        if "adapter_name" in kwargs:
            raise InvalidInputError("adapter_name is set by the server (the run id); do not pass it")
        return getattr(self.model, method)(adapter_name=run_id, **kwargs)

    def forward_backward_many(self, requests: Sequence[AdapterRequest]) -> list[AdapterResult]:
        return self.model.forward_backward_many(requests)

    def sample(
        self,
        run_id: str | None,
        inputs: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | None,
        num_samples: int | None,
        template: Mapping[str, Any] | None = None,
    ) -> SampleResponse:
        """Sample with the run's current adapter (synced LoRA-only first: a few small tensors) or the base model."""
        if isinstance(sampling_params, Mapping):
            sampling_params = SamplingParams.from_dict(dict(sampling_params))
        if run_id is not None:
            CheckpointEngineManager(self.model, self.sampler, adapter_name=run_id).sync_weights()
        self.sampler.set_template(self._template(template or {}))
        return self.sampler.sample(inputs, sampling_params, adapter_name=run_id, num_samples=num_samples)

    def _template(self, kwargs: Mapping[str, Any]) -> Any:
        """Templates by their options, built once: trajectories are encoded on the server."""
        if not all(isinstance(value, (str, int, float, bool, type(None))) for value in kwargs.values()):
            raise InvalidInputError(f"template options must be plain values, got {dict(kwargs)}")
        key = repr(sorted(kwargs.items()))
        if key not in self._templates:
            options = {"model_id": self.model_path, **kwargs}
            if options.pop("template", "Template") != "Template":
                raise ConfigurationError("only the built-in 'Template' can be used for sampling on this server")
            self._templates[key] = build("template", "Template", **options)
        return self._templates[key]
