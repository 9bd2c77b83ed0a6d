import numpy as np
import pytest
import torch

from twinkle.errors import InvalidInputError
from twinkle.loss import per_sequence, per_token


def _unpacked(values_BT, inputs):
    """Each sample's values, read back through seq_starts/seq_lens (what the collator's unpack does)."""
    flat = values_BT.flatten()
    return [
        flat[a : a + n].tolist()
        for a, n in zip(inputs["seq_starts"].tolist(), inputs["seq_lens"].tolist(), strict=True)
    ]


def test_scalars_fill_each_whole_sample_and_nothing_else(data, layout):
    inputs, _ = data.batch(layout)
    advantages = [s.advantage for s in data.samples]
    values_BT = per_token(advantages, inputs, "advantages", dtype=torch.float64)
    assert _unpacked(values_BT, inputs) == [[a] * s.length for a, s in zip(advantages, data.samples, strict=True)]
    assert values_BT.sum().item() == pytest.approx(
        sum(a * s.length for a, s in zip(advantages, data.samples, strict=True))
    )


def test_completion_lists_land_on_the_supervised_tokens(data, layout):
    inputs, _ = data.batch(layout)
    values_BT = per_token([s.old for s in data.samples], inputs, "old_logps", dtype=torch.float64)
    assert _unpacked(values_BT, inputs) == [s.full(s.old) for s in data.samples]


def test_full_length_lists_are_taken_as_they_are(data, layout):
    inputs, _ = data.batch(layout)
    full = [[float(i * 100 + t) for t in range(s.length)] for i, s in enumerate(data.samples)]
    assert _unpacked(per_token(full, inputs, "ref_logps", dtype=torch.float64), inputs) == full


def test_mixed_entry_kinds_and_array_types(data):
    inputs, _ = data.batch("right")
    first, second = data.samples[:2]
    values = [np.float32(0.5), torch.tensor(second.old), *[s.old for s in data.samples[2:]]]
    rows = _unpacked(per_token(values, inputs, "x", dtype=torch.float64), inputs)
    assert rows[0] == [0.5] * first.length
    assert rows[1] == pytest.approx(second.full(second.old))
    assert per_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), inputs, "x").dtype == torch.float32


def test_packed_row_without_seq_starts_follows_seq_lens(data):
    inputs, _ = data.batch("packed")
    del inputs["seq_starts"]
    values_BT = per_token([s.old for s in data.samples], inputs, "old_logps", dtype=torch.float64)
    assert values_BT[0].tolist() == [v for s in data.samples for v in s.full(s.old)]


def test_per_sequence_sums_lists_and_keeps_scalars(data, layout):
    inputs, _ = data.batch(layout)
    expected = [sum(s.ref) for s in data.samples]
    got = per_sequence([s.ref for s in data.samples], inputs, "ref_logps", dtype=torch.float64)
    assert got.tolist() == pytest.approx(expected)
    full = per_sequence([s.full(s.ref) for s in data.samples], inputs, "ref_logps", dtype=torch.float64)
    assert full.tolist() == pytest.approx(expected)
    assert per_sequence(expected, inputs, "ref_logps", dtype=torch.float64).tolist() == pytest.approx(expected)


def test_wrong_length_names_the_input_the_sample_and_both_lengths(data):
    inputs, _ = data.batch("packed")
    values = [s.old for s in data.samples]
    values[1] = values[1][:-1]
    with pytest.raises(InvalidInputError, match=r"old_logps\[1\] has 5 values, but sample 1 has 6 supervised tokens"):
        per_token(values, inputs, "old_logps")
    with pytest.raises(InvalidInputError, match=r"or 8 for every token"):
        per_token(values, inputs, "old_logps")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0, 2.0, 3.0], r"advantages has 3 entries but the batch has 4 samples"),
        (1.0, r"advantages must have one entry per sample \(4\), got float"),
        ([1.0, float("nan"), 0.0, 0.0], r"advantages\[1\] holds nan at position 0"),
        ([1.0, 0.0, [0.1, float("-inf")], 0.0], r"advantages\[2\] holds -inf at position 1"),
        ([1.0, 0.0, "high", 0.0], r"advantages\[2\] is not a number"),
        ([1.0, 0.0, [[0.1]], 0.0], r"advantages\[2\] must be a number or a flat list, got shape \(1, 1\)"),
    ],
)
def test_bad_values_are_rejected_by_name(data, values, message):
    inputs, _ = data.batch("right")
    with pytest.raises(InvalidInputError, match=message):
        per_token(values, inputs, "advantages")


def test_multi_turn_samples_fill_each_supervised_span_in_order():
    """Two assistant turns with a user turn between them: the completion values skip the untrained gap."""
    mask_BT = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [0, 0, 1, 1, 0, 0, 0]], dtype=torch.float)
    inputs = {"loss_mask": mask_BT, "seq_lens": torch.tensor([7, 4]), "seq_starts": torch.tensor([0, 7])}
    values_BT = per_token([[1.0, 2.0, 3.0], [4.0, 5.0]], inputs, "old_logps")
    assert values_BT.tolist() == [[0, 1, 2, 0, 0, 3, 0], [0, 0, 4, 5, 0, 0, 0]]
