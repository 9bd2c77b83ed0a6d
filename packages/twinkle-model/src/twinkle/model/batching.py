"""Turning a call's ``inputs`` into validated features and collated batches, and keeping gradients safe.

Everything that can be wrong with the inputs is checked before the first
forward, so a bad request never half-applies: see :class:`GradGuard` for the
errors that can only show up later (a non-finite loss).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from twinkle.data_format import InputFeature, validate_input_feature
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model.train_state import TrainState


class BatchPreparer:
    """Validates inputs against the model's vocabulary and collates them with an adapter's processor."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def features(self, state: TrainState, inputs: Any) -> list[InputFeature]:
        """Accept one feature, a list of features, or trajectories (encoded with the adapter's template)."""
        if isinstance(inputs, Mapping):
            inputs = [inputs]
        if not isinstance(inputs, Sequence) or isinstance(inputs, (str, bytes)):
            raise InvalidInputError(f"inputs must be a list of InputFeature dicts, got {type(inputs).__name__}")
        if not inputs:
            raise InvalidInputError("inputs is empty: pass at least one sample")
        features = []
        for i, item in enumerate(inputs):
            if isinstance(item, Mapping) and "input_ids" not in item and "messages" in item:
                item = self._encode(state, item, i)
            features.append(validate_input_feature(item, where=f"inputs[{i}]", vocab_size=self.vocab_size))
        return features

    @staticmethod
    def collate(state: TrainState, features: list[InputFeature]) -> dict[str, torch.Tensor]:
        """Collate features already checked by :meth:`features`."""
        return state.processor(features)

    @staticmethod
    def _encode(state: TrainState, trajectory: Mapping[str, Any], index: int) -> InputFeature:
        if state.template is None:
            raise ConfigurationError(f"inputs[{index}] is a trajectory; call set_template(...) so it can be encoded")
        feature = state.template.encode(trajectory)
        if feature is None:
            raise InvalidInputError(f"inputs[{index}] was dropped by the template's truncation strategy")
        return feature


class GradGuard:
    """Restores parameters' gradients if the guarded block raises (no half-applied step)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = params
        self.saved: list[torch.Tensor | None] = []

    def __enter__(self) -> GradGuard:
        return self.save()

    def save(self) -> GradGuard:
        """Remember the current gradients (copies: later backwards accumulate in place)."""
        self.saved = [None if p.grad is None else p.grad.clone() for p in self.params]
        return self

    def restore(self) -> None:
        """Put back the gradients saved on entry."""
        for param, grad in zip(self.params, self.saved, strict=True):
            param.grad = grad

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.restore()
        self.saved = []
