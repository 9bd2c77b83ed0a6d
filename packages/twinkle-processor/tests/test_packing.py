import pytest
import torch

from twinkle.errors import InvalidInputError
from twinkle.processor import InputProcessor

M = -100


def test_packed_layout(features):
    batch = InputProcessor(padding_free=True)(features)

    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33, 34]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    assert batch["labels"].tolist() == [[M, M, 13, 14, 15, M, 22, 23, M, 32, 33, 34]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]]
    assert batch["cu_seq_lens"].tolist() == [0, 5, 8, 12]
    assert batch["cu_seq_lens"].dtype == torch.int32
    assert batch["seq_lens"].tolist() == [5, 3, 4]
    assert batch["seq_starts"].tolist() == [0, 5, 8]
    assert "attention_mask" not in batch  # transformers only detects packing when the mask is None


def test_padding_side_is_irrelevant_when_packing(features):
    left = InputProcessor(padding_free=True, padding_side="left")(features)
    right = InputProcessor(padding_free=True, padding_side="right")(features)

    assert left.keys() == right.keys()
    assert all(torch.equal(left[name], right[name]) for name in left)


def test_no_pair_crosses_a_sequence_boundary(features, shifted_pairs):
    batch = InputProcessor(padding_free=True)(features)
    sequence_of_token = torch.repeat_interleave(torch.arange(3), batch["seq_lens"])

    pairs = shifted_pairs(batch)
    # Without resetting first labels, feature 2's label 31 would be predicted from feature 1's token 23.
    assert len(pairs) == 3 + 2 + 3
    assert all(sequence_of_token[t] == sequence_of_token[t_next] for _, t, t_next in pairs)


def test_single_token_sequences_pack():
    batch = InputProcessor(padding_free=True)([{"input_ids": [5]}, {"input_ids": [6]}, {"input_ids": [7, 8]}])

    assert batch["position_ids"].tolist() == [[0, 0, 0, 1]]
    assert batch["cu_seq_lens"].tolist() == [0, 1, 2, 4]


def test_masked_tokens_cannot_be_packed():
    feature = {"input_ids": [5, 6, 7], "attention_mask": [1, 0, 1]}
    with pytest.raises(InvalidInputError, match=r"features\[1\]\.attention_mask masks position 1"):
        InputProcessor(padding_free=True)([{"input_ids": [1]}, feature])


def test_custom_positions_cannot_be_packed():
    feature = {"input_ids": [5, 6, 7], "position_ids": [4, 5, 6]}
    with pytest.raises(InvalidInputError, match=r"features\[0\]\.position_ids must be 0\.\.2"):
        InputProcessor(padding_free=True)([feature])
