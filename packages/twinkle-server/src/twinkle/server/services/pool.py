"""The models a server holds: the shared base with every tenant's LoRA adapter, and private runs.

Most runs are LoRA adapters on the one frozen base model (a ``MultiLoraModel``,
or on ``backend: megatron`` a ``MultiLoraMegatronModel``: :mod:`.trainers`),
trained together in shared passes. A run that trains every weight, or starts
from a tenant's own full-model checkpoint, needs weights of its own: it gets a
private ``TransformersModel`` (``MegatronModel``; more memory, no batching with others). Sampling
uses a sampler per base model, synced from the run before each request (LoRA
tensors only, or every weight for a full-parameter run); which back-end
(``TorchSampler``, ``vLLMSampler``) is the config's ``sampler`` (:mod:`.samplers`). Sample calls are
generated together, a batch per sampler and template (:meth:`ModelPool.sample_many`, :mod:`.batches`).

Only the scheduler's worker thread calls into the pool, so no model ever sees
two calls at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from peft import LoraConfig

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model import AdapterResult, PassRequest, TrainingModel
from twinkle.module import topk_routers
from twinkle.registry import build
from twinkle.sampler import SampleCall, SampleResult
from twinkle.server.services.batches import SAMPLE, SampleRequest, SharedRequest, batch_kind
from twinkle.server.services.samplers import build_sampler
from twinkle.server.services.trainers import model_classes

if TYPE_CHECKING:
    from twinkle.server.services.samplers import SamplerBackend

# The methods of a tenant's run answered directly (the others get a future); ``app.schemas.calls`` lists all.
SHORT_METHODS = frozenset(
    {
        "set_optimizer",
        "set_lr_scheduler",
        "set_loss",
        "set_template",
        "set_processor",
        "update_optimizer",
        "zero_grad",
        "lr_step",
        "calculate_metric",
    }
)
# Which of ``ServerConfig.model_options`` each kind of model the pool builds takes.
TRAINER_OPTIONS = ("gradient_checkpointing", "kernels")
SAMPLER_OPTIONS = ("kernels", "record_routing")
# A MoE model's routing: (MoE layers, experts per token, experts); what ``routed_experts`` records must fit.
RoutingShape = tuple[int, int, int]


class ModelPool:
    """Every loaded run's weights, and sampling with any of them."""

    def __init__(
        self,
        model_id: str | None,
        max_loras: int,
        max_rank: int,
        device: str | None = None,
        model_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.device = device
        options = dict(model_options or {})  # ServerConfig.model_options, for every model and sampler built here
        self.options = {name: options[name] for name in TRAINER_OPTIONS if name in options}
        self.sampler_options = {name: options[name] for name in SAMPLER_OPTIONS if name in options}
        self.sampler_kind: str = options.get("sampler", "torch")
        self.sampler_args: dict[str, Any] = dict(options.get("sampler_args") or {})
        if self.sampler_kind == "vllm":  # the TorchSampler keyword arguments that have no vLLM counterpart
            self.sampler_options = {k: v for k, v in self.sampler_options.items() if k != "kernels"}
        shared, self.private_class = model_classes(options.get("backend", "transformers"))
        self.model = shared(model_id, max_loras=max_loras, max_rank=max_rank, device=device, **self.options)
        self.model_path = self.model.model_path
        self.routing = routing_shape(self.model.model)
        if self.sampler_options.get("record_routing") and self.routing is None:
            raise ConfigurationError(
                f"record_routing: {type(self.model.model).__name__} ({self.model_path}) has no softmax top-k MoE "
                "router whose routing could be recorded; set it only for a MoE model"
            )
        self._private: dict[str, TrainingModel] = {}
        self._samplers: dict[str, SamplerBackend] = {}  # by base model path; full-parameter runs by run id
        self._templates = Templates(self.model_path)
        if self.sampler_kind != "torch":  # an engine starts slowly: at start-up, where a bad config shows at once
            self._sampler(self.model_path)

    @property
    def max_loras(self) -> int:
        return self.model.max_loras

    @property
    def max_rank(self) -> int:
        return self.model.max_rank

    @property
    def max_length(self) -> int:
        """The longest sequence the base model takes (a vision-language model's: its language model's)."""
        return int(self.model.model.config.get_text_config().max_position_embeddings)

    @property
    def resident_count(self) -> int:
        return len(self.model.adapter_names) + len(self._private)

    def is_private(self, run_id: str) -> bool:
        return run_id in self._private

    def add_run(
        self,
        run_id: str,
        lora_config: Mapping[str, Any] | None,
        gradient_accumulation_steps: int = 1,
        seed: int | None = None,
        base_path: str | None = None,
    ) -> None:
        """Load a run: an adapter in the shared pool, or a private model (full parameters or its own base)."""
        config = None if lora_config is None else _lora_config(lora_config)
        if config is not None and base_path is None:
            self.model.add_adapter_to_model(run_id, config, gradient_accumulation_steps, seed=seed)
            return
        model = self.private_class(base_path or self.model_path, device=self.device, **self.options)
        if config is not None:
            model.add_adapter_to_model(run_id, config, gradient_accumulation_steps, seed=seed)
        elif gradient_accumulation_steps != 1:
            raise InvalidInputError(
                "a full-parameter run accumulates over calls with clip_grad_and_step as is; "
                "gradient_accumulation_steps must be 1"
            )
        self._private[run_id] = model

    def remove_run(self, run_id: str) -> None:
        """Free the run's weights, optimizer and gradients; its checkpoints stay on disk."""
        if self._private.pop(run_id, None) is None and run_id in self.model.adapter_names:
            self.model.remove_adapter(run_id)
        private_sampler = self._samplers.pop(run_id, None)
        if private_sampler is not None:
            private_sampler.close()
        for sampler in self._samplers.values():
            if run_id in sampler.adapter_names:
                sampler.remove_adapter(run_id)

    def call(self, run_id: str, method: str, kwargs: Mapping[str, Any]) -> Any:
        """Run one in-process API method on the run's adapter (or its private model); the HTTP edge has checked
        ``method`` and ``kwargs`` (``adapter_name`` cannot be among them)."""
        model = self._private.get(run_id, self.model)
        adapter = run_id if run_id in model.adapter_names else None
        return getattr(model, method)(adapter_name=adapter, **kwargs)

    def forward_backward_many(self, requests: Sequence[PassRequest]) -> list[AdapterResult]:
        return self.model.forward_backward_many(requests)

    def run_batch(self, requests: Sequence[SharedRequest]) -> list[AdapterResult] | list[SampleResult]:
        """The scheduler's batch of one kind (:func:`.batches.batch_kind`): a shared pass, or sample calls."""
        if batch_kind(requests[0]) == SAMPLE:
            return self.sample_many([request for request in requests if isinstance(request, SampleRequest)])
        return self.forward_backward_many([request for request in requests if not isinstance(request, SampleRequest)])

    def sample_many(self, requests: Sequence[SampleRequest]) -> list[SampleResult]:
        """Sample calls generated together, a batch per sampler and template; each gets its response or error.

        A call's weights are set up first (its run synced, its saved adapter loaded): a failure there is that
        call's alone.
        """
        results = [SampleResult() for _ in requests]
        batches: dict[tuple[int, str], tuple[SamplerBackend, Mapping[str, Any] | None, list[Any]]] = {}
        for result, request in zip(results, requests, strict=True):
            try:
                sampler, adapter = self._sampler_of(request)
            except Exception as exc:  # this call's weights: the others still sample
                result.error = exc
                continue
            call = SampleCall(
                request.inputs, request.params, adapter, request.num_samples, use_base_model=adapter is None
            )
            batch = batches.setdefault((id(sampler), repr(request.template)), (sampler, request.template, []))
            batch[2].append((result, call))
        for sampler, template, calls in batches.values():
            try:
                if template is not None:
                    sampler.set_template(self.template(template, sampler.model_path))
                outcomes = sampler.sample_many([call for _, call in calls])
            except Exception as exc:
                outcomes = [SampleResult(error=exc)] * len(calls)
            for (result, _), outcome in zip(calls, outcomes, strict=True):
                result.output, result.error = outcome.output, outcome.error
        return results

    def sample(
        self,
        run_id: str | None,
        inputs: Any,
        sampling_params: SamplingParams | Mapping[str, Any] | None,
        num_samples: int | None,
        template: Mapping[str, Any] | None = None,
        base_path: str | None = None,
    ) -> SampleResponse:
        """Sample with the run's current weights (synced first), a checkpoint's, or the base model's."""
        if isinstance(sampling_params, Mapping):
            sampling_params = SamplingParams.from_dict(dict(sampling_params))
        request = SampleRequest(
            inputs,
            sampling_params,
            run_id=run_id,
            base_path=base_path,
            num_samples=num_samples,
            template=template or {},
        )
        return self.sample_one(request)

    def snapshot_adapter(self, run_id: str, name: str) -> None:
        """Serve the run's current LoRA weights as sampler adapter ``name``: later training does not change it."""
        if run_id not in self.model.adapter_names:
            raise InvalidInputError(f"run {run_id!r} is not a LoRA adapter on the shared base model")
        config, state_dict = self.model.lora_payload(run_id)
        self._sampler(self.model_path).add_adapter(name, config, state_dict)

    def load_sampler_adapter(self, name: str, path: str) -> None:
        """Serve a saved LoRA adapter directory as sampler adapter ``name``."""
        self._sampler(self.model_path).load_adapter(name, path)

    def drop_sampler_adapter(self, name: str) -> None:
        sampler = self._sampler(self.model_path)
        if name in sampler.adapter_names:
            sampler.remove_adapter(name)

    def sample_one(self, request: SampleRequest) -> SampleResponse:
        """One sample call (a batch of one; the scheduler batches such calls of many tenants)."""
        return self.sample_many([request])[0].unwrap()

    def template(self, spec: Mapping[str, Any] | None, model_path: str | None = None) -> Any:
        """A registered template from ``{"name", "kwargs"}`` for ``model_path`` (default: the base model's)."""
        return self._templates.get(spec, model_path)

    def close(self) -> None:
        """Stop the samplers' engines (a vLLM engine's process and threads)."""
        for sampler in self._samplers.values():
            sampler.close()
        self._samplers.clear()

    def _sampler_of(self, request: SampleRequest) -> tuple[SamplerBackend, str | None]:
        """The request's sampler and adapter, its weights set up: its run's, a checkpoint's, or the shared base's."""
        if request.run_id is not None or request.base_path is not None:
            return self._sampler_for(request.run_id, request.base_path)
        sampler = self._sampler(self.model_path)
        if request.checkpoint is not None:
            assert request.adapter_name is not None  # a saved adapter is loaded under the name it samples with
            if not (request.keep_loaded and request.adapter_name in sampler.adapter_names):
                self.load_sampler_adapter(request.adapter_name, request.checkpoint)
        return sampler, request.adapter_name

    def _sampler_for(self, run_id: str | None, base_path: str | None) -> tuple[SamplerBackend, str | None]:
        """The sampler holding the right base weights, synced with the run; and the adapter to sample with."""
        private = self._private.get(run_id) if run_id is not None else None
        if run_id is not None and private is not None and not private.adapter_names:  # full-parameter: all weights
            sampler = self._sampler(run_id, private.model_path)
            CheckpointEngineManager(private, sampler).sync_weights(merge_and_sync=True)
            return sampler, None
        source = private if private is not None else self.model
        sampler = self._sampler(source.model_path if run_id else (base_path or self.model_path))
        if run_id is not None:
            CheckpointEngineManager(source, sampler, adapter_name=run_id).sync_weights()
        return sampler, run_id

    def _sampler(self, key: str, model_path: str | None = None) -> SamplerBackend:
        if key not in self._samplers:
            self._samplers[key] = build_sampler(
                self.sampler_kind,
                model_path or key,
                self.device,
                self.sampler_options,
                self.sampler_args,
                self.max_loras,
                self.max_rank,
            )
        return self._samplers[key]


def routing_shape(model: Any) -> RoutingShape | None:
    """``model``'s MoE routing (layers, experts per token, experts); ``None`` for a model without MoE routers."""
    routers = topk_routers(model)
    if not routers:
        return None
    return len(routers), int(routers[0].top_k), int(routers[0].num_experts)


class Templates:
    """Registered templates built once per spec; needs only the tokenizer's folder, not the model."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._built: dict[str, Any] = {}

    def get(self, spec: Mapping[str, Any] | None, model_path: str | None = None) -> Any:
        """The template ``{"name", "kwargs"}`` for ``model_path`` (default: the base model's); the HTTP edge
        has checked the spec (a registered name, plain option values)."""
        spec = dict(spec or {})
        name = spec.get("name", "Template")
        kwargs = dict(spec.get("kwargs") or {})
        kwargs["model_id"] = model_path or self.model_path  # the tokenizer of the weights being used
        key = repr((name, sorted(kwargs.items())))
        if key not in self._built:
            self._built[key] = build("template", name, **kwargs)
        return self._built[key]


def _lora_config(lora_config: Any) -> LoraConfig:
    if not isinstance(lora_config, Mapping):
        kind = type(lora_config).__name__
        raise InvalidInputError(f"lora_config must be an object of LoraConfig fields (or null), got {kind}")
    try:
        return LoraConfig(**lora_config)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"invalid lora_config {dict(lora_config)}: {exc}") from exc
