"""Recorded MoE routing (``routed_experts``) is collated in the batch's own token layout, free (-1) elsewhere."""

from __future__ import annotations

import pytest
import torch

from twinkle.errors import InvalidInputError
from twinkle.processor import InputProcessor


def _routed(length: int, base: int) -> list[list[list[int]]]:
    return [[[base + t, base + t + 1], [base, base]] for t in range(length)]  # 2 layers, top-2


FEATURES = [
    {"input_ids": [5, 6, 7], "routed_experts": _routed(3, 10)},
    {"input_ids": [8]},  # sampled without a record: routes freely
    {"input_ids": [9, 4], "routed_experts": _routed(2, 20)},
]


@pytest.mark.parametrize(
    "processor",
    [InputProcessor(), InputProcessor(padding_side="left"), InputProcessor(padding_free=True)],
    ids=["right", "left", "packed"],
)
def test_routing_follows_each_layout(processor):
    batch = processor(FEATURES)
    routed_BTLK = batch["routed_experts"]
    assert routed_BTLK.shape == (*batch["input_ids"].shape, 2, 2)
    flat_NLK = routed_BTLK.flatten(0, 1)
    for feature, start, length in zip(FEATURES, batch["seq_starts"].tolist(), batch["seq_lens"].tolist(), strict=True):
        expected = torch.tensor(feature.get("routed_experts") or [[[-1, -1]] * 2] * length)
        assert torch.equal(flat_NLK[start : start + length], expected)
    assert int((flat_NLK == -1).all(-1).all(-1).sum()) == flat_NLK.shape[0] - 5  # padding and the unrecorded one


def test_no_record_no_tensor_and_mismatched_records_are_refused():
    assert "routed_experts" not in InputProcessor()([{"input_ids": [1, 2]}])
    with pytest.raises(InvalidInputError, match=r"differ in \(layers, top_k\): \[\(1, 2\), \(2, 2\)\]"):
        InputProcessor()([FEATURES[0], {"input_ids": [3], "routed_experts": [[[1, 2]]]}])
    with pytest.raises(InvalidInputError, match=r"features\[0\].routed_experts\[1\] is 1 layers x 2 experts"):
        InputProcessor()([{"input_ids": [3, 4], "routed_experts": [[[1, 2], [3, 4]], [[1, 2]]]}])
