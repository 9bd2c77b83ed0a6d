"""Request values reach the in-process API as it takes them: feature ids as lists, other arrays as arrays."""

from __future__ import annotations

import numpy as np

from twinkle.server.services.convert import from_wire


def test_ids_in_features_become_lists_and_everything_else_keeps_its_type():
    advantages = np.array([0.5, -0.5], dtype=np.float32)
    request = {
        "inputs": [
            {"input_ids": np.array([5, 6, 7]), "labels": [-100, 6, 7], "user_data": {"ids": np.array([1])}},
            {"input_ids": [8, 9], "position_ids": np.array([0, 1], dtype=np.int32)},
        ],
        "advantages": advantages,
        "scores": [1.0, 2.5, None],
    }
    converted = from_wire(request)
    first, second = converted["inputs"]
    assert first["input_ids"] == [5, 6, 7] and type(first["input_ids"]) is list
    assert first["labels"] == [-100, 6, 7]
    assert isinstance(first["user_data"]["ids"], np.ndarray)  # not a feature field
    assert second == {"input_ids": [8, 9], "position_ids": [0, 1]} and type(second["position_ids"]) is list
    assert converted["advantages"] is advantages and converted["scores"] == [1.0, 2.5, None]
