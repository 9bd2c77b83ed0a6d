"""Interfaces of the RL components: Reward, Advantage, Sampler, CheckpointEngine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from twinkle.data_format import InputFeature, SampleResponse, SamplingParams, Trajectory


class Reward(ABC):
    """Scores completed trajectories (or input features carrying ``messages``/``user_data``)."""

    @abstractmethod
    def __call__(self, trajectories: Sequence[Mapping[str, Any]]) -> list[float]:
        """One float per trajectory."""


class Advantage(ABC):
    """Turns rewards (and possibly values) into per-sample or per-token advantages."""

    @abstractmethod
    def __call__(self, rewards: Sequence[float], *args: Any, **kwargs: Any) -> Any:
        """Advantages aligned with ``rewards``; each estimator names what else it takes (``num_generations``...)."""


@runtime_checkable
class Sampler(Protocol):
    """Generates completions for prompts, with a LoRA adapter (or none) per prompt.

    ``inputs`` are encoded prompts (``InputFeature``) or trajectories, which the
    template from :meth:`set_template` encodes with the generation prompt.
    ``adapter_name`` is one adapter for every input or a list with one entry
    per input (``None`` entries: the base model); omitted, it is the sampler's
    only adapter (the base model when it serves none, an error when several);
    ``use_base_model=True`` samples the bare base model.
    """

    @property
    def adapter_names(self) -> list[str]:
        """The adapters :meth:`sample` can name."""
        ...

    def set_template(self, template: Any, **kwargs: Any) -> None: ...

    def sample(
        self,
        inputs: InputFeature | Trajectory | Sequence[InputFeature | Trajectory],
        sampling_params: SamplingParams | None = None,
        adapter_name: str | Sequence[str | None] | None = None,
        num_samples: int | None = None,
        use_base_model: bool = False,
    ) -> SampleResponse:
        """``num_samples`` completions per input (default ``sampling_params.num_samples``), prompt-major."""
        ...

    def add_adapter(self, name: str, config: Any, state_dict: Mapping[str, Any]) -> None:
        """Serve adapter ``name`` from its ``LoraConfig`` (or dict) and PEFT-format tensors."""
        ...

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Serve the adapter saved in PEFT format in directory ``path`` as ``name``."""
        ...

    def remove_adapter(self, name: str) -> None: ...


@runtime_checkable
class CheckpointEngine(Protocol):
    """Moves trained weights from a model into a sampler."""

    def sync_weights(self, merge_and_sync: bool = False) -> None: ...
