"""``MegatronModel``: the semantic training API on megatron-core, with model parallelism on any device.

The model is megatron-core's ``GPTModel`` (its tensor-parallel layers; the core attention of
:mod:`.attention`; a MoE model's layers of :mod:`.moe`), filled from a transformers checkpoint through
:mod:`.conversion`, and saved back as one. Every call runs through the same pass engine, losses and
metrics as :class:`TransformersModel`: the engine sees a causal LM (:class:`.causal_lm.MegatronCausalLM`)
whose output layer computes log-probs from each tensor-parallel rank's slice of the vocabulary.
``DeviceMesh.from_sizes(tp_size=..., pp_size=..., ep_size=..., dp_size=...)`` under torchrun splits it
(pipeline stages: :mod:`.pipeline`; experts: :mod:`.plan`); without a mesh it runs in this process. It
trains every weight, or LoRA adapters in PEFT's format (:mod:`.lora`, :mod:`.expert_lora`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle.errors import ConfigurationError
from twinkle.infra import remote_class
from twinkle.model.checkpoints.save_load import read_weight_files
from twinkle.model.loading import CheckpointingPolicy, enable_activation_checkpointing
from twinkle.model.megatron.causal_lm import MegatronCausalLM
from twinkle.model.megatron.conversion import check_supported, to_megatron, to_transformers
from twinkle.model.megatron.expert_lora import full_name
from twinkle.model.megatron.lora import HEAD
from twinkle.model.megatron.plan import MegatronParallel
from twinkle.model.megatron.stage_states import names_over_stages
from twinkle.model.multi_lora_adapters import as_peft_resolves
from twinkle.model.parallel import Parallelism
from twinkle.model.train_state import FULL_MODEL, TrainState
from twinkle.model.training_model import TrainingModel
from twinkle.module import ExpertLora, check_lora_keys, read_adapter_dir, write_adapter_dir
from twinkle.patch import KernelsSpec, MegatronAutocastPatch, PatchSpec, apply_patch
from twinkle.registry import register

# transformers' options of a MoE model's router loss, which MegatronModel takes too.
ROUTER = ("output_router_logits", "router_aux_loss_coef")
# The model options MegatronModel takes besides them (``pipeline_schedule``: see MegatronCausalLM).
OWN_OPTIONS = ("dtype", "attn_implementation", "pipeline_schedule")


@register("model")
@remote_class
class MegatronModel(TrainingModel):
    """A transformers checkpoint trained on megatron-core; see the module docstring and :class:`TrainingModel`."""

    supports_data_parallel = True

    def _parallelism(self) -> Parallelism:
        sizes = [self.device_mesh.size(dim) if self.device_mesh is not None else 1 for dim in ("tp", "pp", "ep")]
        config = AutoConfig.from_pretrained(self.model_path)
        check_supported(config, *sizes)  # before any group or layer exists
        return MegatronParallel(self.device_mesh, self.device, config.num_hidden_layers)

    def _load_model(
        self,
        gradient_checkpointing: CheckpointingPolicy,
        kernels: KernelsSpec,
        patches: Sequence[PatchSpec],
        options: dict[str, Any],
    ) -> Any:
        unsupported = {
            "kernels": kernels,
            "patches": list(patches),
            **{key: value for key, value in options.items() if key not in (*OWN_OPTIONS, *ROUTER)},
        }
        chosen = {key: value for key, value in unsupported.items() if value}
        if chosen:
            raise ConfigurationError(f"MegatronModel does not take {sorted(chosen)} yet")
        parallel = self.parallel
        assert isinstance(parallel, MegatronParallel)
        router = {key: options[key] for key in ROUTER if key in options}  # the load-balancing loss, as transformers'
        config = AutoConfig.from_pretrained(self.model_path, **router)
        with torch.random.fork_rng(devices=[]):  # building the layers must not move the data's random stream
            model = MegatronCausalLM(
                config,
                options["dtype"],
                parallel.tp_group,
                parallel.tp_rank,
                parallel.tp_size,
                parallel.stage,
                options.get("pipeline_schedule", "1f1b"),
            )
        model.to(device=self.device, dtype=options["dtype"])  # megatron builds its norms in float32 regardless
        source = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=options["dtype"])
        _copy_whole_weights(model, parallel, to_megatron(source.state_dict(), config))
        parallel.shard_experts(model)  # each expert-parallel rank keeps its block of them (cut from the whole)
        if parallel.experts is not None:  # and the experts' LoRA pairs, too
            model.lora.expert_block = (parallel.experts.rank_in_group, parallel.experts.size)
        enable_activation_checkpointing(model, gradient_checkpointing)
        if self.device.type == "cpu" and self.mixed_precision != "no":  # megatron restores autocast on CUDA only
            apply_patch(model, MegatronAutocastPatch("cpu"))
        return model.train()

    def load_full_weights(self, path: Path) -> None:
        try:
            whole = to_megatron(read_weight_files(path), self.model.config)
        except KeyError as exc:
            raise ConfigurationError(f"{path} does not match this model: it has no {exc}") from exc
        _copy_whole_weights(self.model, self.parallel, whole)

    # ------------------------------------------------------------------ LoRA adapters (.lora)

    def _add_adapter(self, adapter_name: str, config: PeftConfig, directory: Path | None) -> list[torch.nn.Parameter]:
        model: MegatronCausalLM = self.model
        like = next(model.gpt.parameters())  # the pairs take the base weights' dtype and device
        sizes, layers, experts = model.projection_sizes(), model.stage_layers, model.expert_sizes()
        if experts is not None and isinstance(config, LoraConfig):
            config = as_peft_resolves(_meta_model(model.config), config)  # "all-linear" adds experts and router
        head = (model.config.vocab_size, model.config.hidden_size)
        pipeline = model.stage.size > 1
        model.lora.add(
            adapter_name, config, model.config.num_hidden_layers, sizes, like, layers, experts, head, pipeline
        )
        try:
            if directory:
                self.load_adapter_weights(adapter_name, directory)
        except Exception:
            model.lora.remove(adapter_name)
            raise
        model.gpt.requires_grad_(False)  # the base is frozen while adapters train
        self._states.pop(FULL_MODEL, None)  # only evaluated (or failed) without adapters: adapters replace it
        return model.lora.parameters_of(adapter_name)

    def _route_rows(
        self, row_adapters: Sequence[str | None], batch: Mapping[str, torch.Tensor] | None
    ) -> AbstractContextManager[None]:
        return self.model.lora.routed(row_adapters, self.device)

    # ------------------------------------------------------------------ weight sync (CheckpointEngineManager)

    def lora_payload(self, adapter_name: str) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
        """The adapter's config and whole PEFT-format tensors (a collective under torchrun: every rank calls it)."""
        state = self.train_state(adapter_name)
        return self.model.lora.configs[state.name], self.parallel.gathered(self.model, self.adapter_state_dict(state))

    def merged_weights(self, adapter_name: str | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight whole under transformers' names, with the adapter (if any) merged in (a collective)."""
        model: MegatronCausalLM = self.model
        whole = self.parallel.gathered(model, {f"gpt.{k}": p for k, p in model.gpt.named_parameters()})  # all stages
        weights = to_transformers({name.removeprefix("gpt."): t for name, t in whole.items()}, model.config)
        state = self.train_state(adapter_name)
        if state.is_adapter:
            scaling = model.lora.scaling[state.name]
            if HEAD in scaling and model.config.tie_word_embeddings:
                raise ConfigurationError(
                    f"adapter {state.name!r} adapts {HEAD}, whose weight is tied to the input embeddings: merged, "
                    "the update would change both; sync the adapter itself (merge_and_sync=False)"
                )
            _, pairs = self.lora_payload(state.name)
            experts = {
                module: full_name(layer, param)
                for (layer, param), module in model.lora.expert_modules.get(state.name, {}).items()
            }
            with torch.no_grad():
                for module, factor in scaling.items():
                    A = pairs[f"base_model.model.{module}.lora_A.weight"]
                    B = pairs[f"base_model.model.{module}.lora_B.weight"]
                    if module in experts:  # a MoE parameter: the router's [E, H], or fused experts' [E, out, in]
                        count = 1 if experts[module].endswith(".gate.weight") else model.lora.num_experts
                        delta = ExpertLora.from_peft(A, B, count, factor).delta_weight()
                        weights[experts[module]] = weights[experts[module]] + delta.view_as(weights[experts[module]])
                    else:
                        weights[f"{module}.weight"] = weights[f"{module}.weight"] + factor * (B @ A)
        return iter(weights.items())

    def adapter_state_dict(self, state: TrainState) -> dict[str, torch.Tensor]:
        return self.model.lora.state_dict_of(state.name)

    def write_adapter_files(self, state: TrainState, directory: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        config = self.model.lora.configs[state.name]
        config.base_model_name_or_path = self.model_path
        write_adapter_dir(directory, config, tensors)

    def load_adapter_weights(self, adapter_name: str, directory: Path) -> None:
        """A PEFT adapter's whole pairs, cut to this rank's parts; all are checked before any is copied."""
        own = self.model.lora.state_dict_of(adapter_name)
        pairs = read_adapter_dir(directory)[1]
        check_lora_keys(adapter_name, pairs)  # e.g. base weights PEFT saved beside the pairs, named
        _copy_whole(self.model, self.parallel, own, pairs, f"adapter {adapter_name!r}")


def _meta_model(config: Any) -> Any:
    """The transformers model of ``config`` without storage: what PEFT resolves a ``LoraConfig`` against."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def _copy_whole_weights(model: MegatronCausalLM, parallel: Parallelism, whole: Mapping[str, torch.Tensor]) -> None:
    """Copy whole megatron-named tensors into this rank's shards of the model's weights (its stage's layers)."""
    own = {model.stage.global_name(name): param for name, param in model.gpt.named_parameters()}
    _copy_whole(model, parallel, own, whole, "checkpoint")


def _copy_whole(
    model: MegatronCausalLM,
    parallel: Parallelism,
    own: Mapping[str, torch.Tensor],
    whole: Mapping[str, torch.Tensor],
    what: str,
) -> None:
    """Copy each whole tensor into this rank's part of ``own``'s tensor of that name; all are checked first.

    ``whole`` holds every pipeline stage's tensors; each stage copies its own.
    """
    every = set(names_over_stages(sorted(own), model.stage)) if model.stage.size > 1 else set(own)
    missing, unexpected = sorted(every - set(whole)), sorted(set(whole) - every)
    if missing or unexpected:
        raise ConfigurationError(f"{what} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    parts = {name: parallel.local_part(model, own[name], tensor) for name, tensor in whole.items() if name in own}
    wrong = [name for name, part in parts.items() if part.shape != own[name].shape]
    if wrong:
        raise ConfigurationError(f"{what} does not fit the model: other shapes for {wrong[:3]}")
    with torch.no_grad():
        for name, part in parts.items():
            own[name].copy_(part)
