import pytest
import torch

from twinkle.processor import InputProcessor

M = -100  # IGNORE_INDEX, short so the expected tables line up


def test_right_padding_values(features):
    batch = InputProcessor(padding_side="right", pad_token_id=7)(features)

    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 7, 7], [31, 32, 33, 34, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0], [0, 1, 2, 3, 0]]
    # feature 2 labelled its first token: it is dropped, it can never be predicted.
    assert batch["labels"].tolist() == [[M, M, 13, 14, 15], [M, 22, 23, M, M], [M, 32, 33, 34, M]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 1, 0]]
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["seq_lens"].tolist() == [5, 3, 4]
    assert batch["seq_starts"].tolist() == [0, 5, 10]
    assert "cu_seq_lens" not in batch


def test_left_padding_values(features):
    batch = InputProcessor(padding_side="left")(features)

    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 15], [0, 0, 21, 22, 23], [0, 31, 32, 33, 34]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2], [0, 0, 1, 2, 3]]
    assert batch["labels"].tolist() == [[M, M, 13, 14, 15], [M, M, M, 22, 23], [M, M, 32, 33, 34]]
    assert batch["seq_starts"].tolist() == [0, 7, 11]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_no_pair_trained_from_padding(features, shifted_pairs, padding_side):
    batch = InputProcessor(padding_side=padding_side)(features)

    pairs = shifted_pairs(batch)
    assert len(pairs) == 3 + 2 + 3
    assert all(batch["attention_mask"][row, t] == 1 for row, t, _ in pairs)


def test_missing_fields_are_derived():
    batch = InputProcessor()([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9]}])

    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["labels"].tolist() == [[M, 6, 7], [M, M, M]]  # from loss_mask; unlabelled: all ignored
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]


def test_given_position_ids_and_attention_mask_are_kept():
    feature = {"input_ids": [5, 6, 7], "position_ids": [3, 4, 5], "attention_mask": [0, 1, 1]}
    batch = InputProcessor()([feature, {"input_ids": [8]}])

    assert batch["position_ids"].tolist() == [[3, 4, 5], [0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_pad_token_id_is_settable_by_the_model(features):
    processor = InputProcessor()
    processor.pad_token_id = 151643

    assert processor(features)["input_ids"][1, 3:].tolist() == [151643, 151643]


def test_device_follows_argument_and_mesh(features):
    from twinkle.infra import DeviceMesh

    assert InputProcessor(device="cpu")(features)["input_ids"].device == torch.device("cpu")
    assert InputProcessor(device_mesh=DeviceMesh.from_sizes(world_size=2)).device == torch.device("cpu")
    assert InputProcessor().device is None
