"""Many tenants' adapters on one frozen base, trained together: what every multi-LoRA back-end shares.

:class:`SharedPasses` is mixed into a :class:`TrainingModel` whose back-end routes each batch row to its
own adapter (``_route_rows`` with several names): ``MultiLoraModel`` on transformers,
``MultiLoraMegatronModel`` on megatron-core. It bounds how many adapters are resident (``max_loras``)
and their ranks (``max_rank``), removes adapters at run time, and trains several adapters' requests,
each with its own loss, in one forward and backward pass (:meth:`SharedPasses.forward_backward_many`).
"""

from __future__ import annotations

import gc
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from peft import LoraConfig

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model.passes.loss_inputs import check_micro_batch_size
from twinkle.model.passes.plans import LossPlan, Plan, TargetsPlan
from twinkle.model.passes.requests import AdapterRequest, AdapterResult, TargetsRequest, model_limits
from twinkle.model.training_model import TrainingModel


class SharedPasses(TrainingModel):
    """Up to ``max_loras`` resident LoRA adapters of rank at most ``max_rank``; see the module docstring."""

    trains_full_model = False

    def __init__(self, model_id: str | None = None, max_loras: int = 8, max_rank: int = 64, **kwargs: Any) -> None:
        for option, value in (("max_loras", max_loras), ("max_rank", max_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{option} must be an int >= 1, got {value!r}")
        super().__init__(model_id, **kwargs)
        self.model.requires_grad_(False)  # the base is shared by every tenant: only adapters train
        self.max_loras = max_loras
        self.max_rank = max_rank

    def _check_capacity(self) -> None:
        """Refuse a new adapter when every slot is taken."""
        if len(self.adapter_names) >= self.max_loras:
            raise ConfigurationError(
                f"all {self.max_loras} adapter slots are in use ({sorted(self.adapter_names)}); remove one first"
            )

    def remove_adapter(self, adapter_name: str) -> None:
        """Drop an adapter with its optimizer, scheduler and gradients; its saved checkpoints stay loadable."""
        self.train_state(adapter_name)  # a clear error for an unknown name
        self._drop_adapter(adapter_name)
        del self._states[adapter_name]
        gc.collect()  # optimizer state and autograd graphs can hold reference cycles

    @abstractmethod
    def _drop_adapter(self, adapter_name: str) -> None:
        """Remove the adapter's weights from the model."""

    @abstractmethod
    def adapter_config(self, adapter_name: str) -> LoraConfig:
        """The adapter's ``LoraConfig`` as it was resolved against the model."""

    @abstractmethod
    def lora_payload(self, adapter_name: str) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
        """The adapter's config and whole PEFT-format tensors (what a sampler loads; ``CheckpointEngineManager``)."""

    @abstractmethod
    def merged_weights(self, adapter_name: str | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every base weight under transformers' names, with the adapter (if any) merged in."""

    def forward_backward_many(
        self,
        requests: Sequence[AdapterRequest | TargetsRequest | Mapping[str, Any]],
        micro_batch_size: int | None = None,
    ) -> list[AdapterResult]:
        """One forward and backward over several adapters' requests, each with its own loss.

        Each request is an :class:`AdapterRequest` (features and the adapter's
        registered loss, as ``forward_backward`` takes them; without
        ``backward``, as ``forward_only`` does) or a :class:`TargetsRequest`
        (explicit targets and a loss function, as ``forward_backward_targets``
        takes them), or a dict of either's fields. Requests without a backward
        share a pass of their own, in eval mode.
        Returns one :class:`AdapterResult` per request, in order: the output the
        single-adapter call would return, or the error that stopped it. A
        failing request (bad input, an exception in its loss, a non-finite
        loss) leaves its adapter exactly as it was and does not change any
        other request's result.
        """
        check_micro_batch_size(micro_batch_size)
        results: list[AdapterResult] = []
        plans: list[Plan] = []
        for index, request in enumerate(requests):
            result = AdapterResult(_adapter_name(request))
            results.append(result)
            try:
                plans.append(self._plan(request, index, result, {plan.state.name for plan in plans}, micro_batch_size))
            except Exception as exc:  # reported to this request only
                result.error = exc
        self._engine.run(plans, micro_batch_size)
        return results

    def _plan(
        self, request: Any, index: int, result: AdapterResult, taken: set[str], micro_batch_size: int | None
    ) -> Plan:
        """Validate one request completely before anything runs."""
        if isinstance(request, Mapping):
            request = TargetsRequest(**request) if "sequences" in request else AdapterRequest(**request)
        if not isinstance(request, (AdapterRequest, TargetsRequest)):
            kind = type(request).__name__
            raise InvalidInputError(
                f"requests[{index}] must be an AdapterRequest, a TargetsRequest or a dict, got {kind}"
            )
        name = request.adapter_name
        if not isinstance(name, str):
            raise InvalidInputError(f"requests[{index}].adapter_name must name an adapter, got {name!r}")
        if name in taken:
            raise InvalidInputError(f"adapter {name!r} appears in more than one request: merge its batches into one")
        state = self.train_state(name)
        if isinstance(request, TargetsRequest):
            limits = model_limits(self.model)
            return TargetsPlan(
                state, result, request.sequences, request.loss_fn, request.backward, limits, self.parallel
            )
        features = self._batches.features(state, request.inputs)
        return LossPlan(state, result, features, request.loss_inputs, self.parallel, request.backward, micro_batch_size)


def _adapter_name(request: Any) -> str | None:
    name = request.get("adapter_name") if isinstance(request, Mapping) else getattr(request, "adapter_name", None)
    return name if isinstance(name, str) else None
