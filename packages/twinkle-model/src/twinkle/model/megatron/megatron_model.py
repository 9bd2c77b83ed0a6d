"""``MegatronModel``: the semantic training API on megatron-core, with tensor parallelism on any device.

The model is megatron-core's ``GPTModel`` (its tensor-parallel layers; the core attention of
:mod:`.attention`), filled from a transformers checkpoint through :mod:`.conversion`, and saved back as
one. Every call runs through the same pass engine, losses and metrics as :class:`TransformersModel`:
the engine sees a causal LM (:class:`.causal_lm.MegatronCausalLM`) whose output layer gathers each
chunk's logits over the tensor-parallel group. ``DeviceMesh.from_sizes(tp_size=..., dp_size=...)``
under torchrun splits it; without a mesh it runs in this process. This back-end trains every weight;
LoRA adapters, pipeline and expert parallelism are not built yet and are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import PeftConfig
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle.errors import ConfigurationError, ResourceNotFoundError
from twinkle.infra import remote_class
from twinkle.model.loading import CheckpointingPolicy
from twinkle.model.megatron.causal_lm import MegatronCausalLM
from twinkle.model.megatron.conversion import check_supported, to_megatron
from twinkle.model.megatron.plan import TensorParallel
from twinkle.model.parallel import Parallelism
from twinkle.model.train_state import TrainState
from twinkle.model.training_model import TrainingModel
from twinkle.patch import KernelsSpec, PatchSpec
from twinkle.registry import register

_NOT_YET = "MegatronModel trains the full model; LoRA adapters on megatron-core layers are not built yet"


@register("model")
@remote_class
class MegatronModel(TrainingModel):
    """A transformers checkpoint trained on megatron-core; see the module docstring and :class:`TrainingModel`."""

    supports_data_parallel = True

    def _parallelism(self) -> Parallelism:
        tp_size = self.device_mesh.size("tp") if self.device_mesh is not None else 1
        check_supported(AutoConfig.from_pretrained(self.model_path), tp_size)  # before any group or layer exists
        return TensorParallel(self.device_mesh, self.device)

    def _load_model(
        self,
        gradient_checkpointing: CheckpointingPolicy,
        kernels: KernelsSpec,
        patches: Sequence[PatchSpec],
        options: dict[str, Any],
    ) -> Any:
        unsupported = {
            "gradient_checkpointing": gradient_checkpointing,
            "kernels": kernels,
            "patches": list(patches),
            **{key: value for key, value in options.items() if key not in ("dtype", "attn_implementation")},
        }
        chosen = {key: value for key, value in unsupported.items() if value}
        if chosen:
            raise ConfigurationError(f"MegatronModel does not take {sorted(chosen)} yet")
        parallel = self.parallel
        assert isinstance(parallel, TensorParallel)
        config = AutoConfig.from_pretrained(self.model_path)
        with torch.random.fork_rng(devices=[]):  # building the layers must not move the data's random stream
            model = MegatronCausalLM(config, options["dtype"], parallel.tp_group, parallel.tp_rank, parallel.tp_size)
        model.to(self.device)
        source = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=options["dtype"])
        _copy_whole_weights(model, parallel, to_megatron(source.state_dict(), config))
        return model.train()

    def load_full_weights(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ResourceNotFoundError(f"{path} has no *.safetensors model weights")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        try:
            whole = to_megatron(state, self.model.config)
        except KeyError as exc:
            raise ConfigurationError(f"{path} does not match this model: it has no {exc}") from exc
        parallel = self.parallel
        assert isinstance(parallel, TensorParallel)
        _copy_whole_weights(self.model, parallel, whole)

    # ------------------------------------------------------------------ adapters: not built yet

    def _add_adapter(self, adapter_name: str, config: PeftConfig, directory: Path | None) -> list[torch.nn.Parameter]:
        raise ConfigurationError(_NOT_YET)

    @contextmanager
    def _route_rows(self, row_adapters: Sequence[str | None]) -> Iterator[None]:
        yield  # no adapters: every row runs the full model

    def adapter_state_dict(self, state: TrainState) -> dict[str, torch.Tensor]:
        raise ConfigurationError(_NOT_YET)

    def write_adapter_files(self, state: TrainState, directory: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        raise ConfigurationError(_NOT_YET)

    def load_adapter_weights(self, adapter_name: str, directory: Path) -> None:
        raise ConfigurationError(_NOT_YET)


def _copy_whole_weights(model: MegatronCausalLM, parallel: TensorParallel, whole: Mapping[str, torch.Tensor]) -> None:
    """Copy whole megatron-named tensors into this rank's shards; all are checked before any is copied."""
    params = dict(model.gpt.named_parameters())
    missing, unexpected = sorted(set(params) - set(whole)), sorted(set(whole) - set(params))
    if missing or unexpected:
        raise ConfigurationError(
            f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    parts = {name: parallel.local_part(model, params[name], tensor) for name, tensor in whole.items()}
    wrong = [name for name, part in parts.items() if part.shape != params[name].shape]
    if wrong:
        raise ConfigurationError(f"checkpoint does not fit the model: other shapes for {wrong[:3]}")
    with torch.no_grad():
        for name, part in parts.items():
            params[name].copy_(part)
