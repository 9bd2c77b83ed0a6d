"""Turning a call's ``inputs`` (features, or trajectories for the adapter's template) into validated features.

Everything that can be wrong with the inputs is checked before the first
forward, so a bad request never half-applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.data_format import InputFeature, validate_input_feature
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model.train_state import TrainState


class BatchPreparer:
    """Validates inputs against the model's vocabulary (trajectories are encoded with the adapter's template)."""

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
    def _encode(state: TrainState, trajectory: Mapping[str, Any], index: int) -> InputFeature:
        if state.template is None:
            raise ConfigurationError(f"inputs[{index}] is a trajectory; call set_template(...) so it can be encoded")
        feature = state.template.encode(trajectory)
        if feature is None:
            raise InvalidInputError(f"inputs[{index}] was dropped by the template's truncation strategy")
        return feature
