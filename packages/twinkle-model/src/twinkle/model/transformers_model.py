"""``TransformersModel``: the semantic training API with LoRA adapters through PEFT.

Several named adapters may live on one model; each call trains or evaluates
one of them (PEFT's active adapter). Without adapters every weight trains.
For many adapters trained together in one pass, see :class:`MultiLoraModel`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from peft import PeftConfig, PeftModel

from twinkle.errors import ConfigurationError
from twinkle.infra import remote_class
from twinkle.model import peft_adapters
from twinkle.model.train_state import FULL_MODEL, TrainState
from twinkle.model.training_model import TrainingModel
from twinkle.registry import register


@register("model")
@remote_class
class TransformersModel(TrainingModel):
    """A transformers causal LM with PEFT LoRA adapters (or none); see :class:`TrainingModel` for the API."""

    def _add_adapter(self, adapter_name: str, config: PeftConfig, directory: Path | None) -> list[torch.nn.Parameter]:
        self.model = peft_adapters.add_adapter(self.model, adapter_name, config)
        self._states.pop(FULL_MODEL, None)  # only evaluated (or failed) without adapters: adapters replace it
        if directory:
            self.load_adapter_weights(adapter_name, directory)
        return peft_adapters.adapter_parameters(self.model, adapter_name)

    @contextmanager
    def _route_rows(
        self, row_adapters: Sequence[str | None], batch: Mapping[str, torch.Tensor] | None
    ) -> Iterator[None]:
        names = set(row_adapters)
        if len(names) > 1:  # PEFT runs one active adapter per forward
            raise ConfigurationError(f"TransformersModel runs one adapter per forward, got {sorted(map(str, names))}")
        name = next(iter(names), None)
        if isinstance(self.model, PeftModel) and name is not None:
            self.model.set_adapter(name)
            for param in self.train_state(name).params:  # PEFT may freeze inactive adapters; ours must train
                param.requires_grad_(True)
        yield

    def adapter_state_dict(self, state: TrainState) -> dict[str, torch.Tensor]:
        return peft_adapters.adapter_state_dict(self.model, state.name)

    def write_adapter_files(self, state: TrainState, directory: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        peft_adapters.save_adapter(self.model, state.name, directory, self.model_path, tensors)

    def load_adapter_weights(self, adapter_name: str, directory: Path) -> None:
        local_part = partial(self.parallel.local_part, self.model)
        peft_adapters.load_adapter_weights(self.model, adapter_name, directory, local_part)
