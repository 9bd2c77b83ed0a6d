"""Interfaces of the RL components: Reward, Advantage, Sampler, CheckpointEngine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
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
    def __call__(self, rewards: Sequence[float], **kwargs: Any) -> Any:
        """Advantages aligned with ``rewards``."""


@runtime_checkable
class Sampler(Protocol):
    """Generates completions for prompts, optionally with a LoRA adapter per request."""

    def sample(
        self,
        inputs: Sequence[InputFeature | Trajectory],
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> SampleResponse: ...


@runtime_checkable
class CheckpointEngine(Protocol):
    """Moves trained weights from a model into a sampler."""

    def sync_weights(self, merge_and_sync: bool = False) -> None: ...
