import pytest
import torch

from twinkle.errors import InvalidInputError
from twinkle.processor import InputProcessor, unpack


@pytest.mark.parametrize(
    "processor",
    [InputProcessor(padding_side="right"), InputProcessor(padding_side="left"), InputProcessor(padding_free=True)],
    ids=["right", "left", "packed"],
)
def test_unpack_round_trips_every_layout(features, processor):
    batch = processor(features)

    assert [t.tolist() for t in unpack(batch["input_ids"], batch)] == [f["input_ids"] for f in features]
    # A per-token tensor with trailing dims (e.g. logits [B, T, V]) keeps them.
    logits = batch["input_ids"].unsqueeze(-1) * torch.tensor([1.0, -1.0])
    per_sequence = unpack(logits, batch)
    assert [tuple(t.shape) for t in per_sequence] == [(5, 2), (3, 2), (4, 2)]
    assert per_sequence[1][:, 1].tolist() == [-21.0, -22.0, -23.0]


def test_unpack_rejects_a_tensor_of_another_layout(features):
    batch = InputProcessor()(features)

    with pytest.raises(InvalidInputError, match=r"shape \(3, 4\).*input_ids \(3, 5\)"):
        unpack(batch["input_ids"][:, 1:], batch)
