from importlib.metadata import entry_points

import pytest

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.infra import DeviceMesh
from twinkle.processor import InputProcessor
from twinkle.registry import build


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize(
    ("features", "message"),
    [
        ([], r"empty batch"),
        ({"input_ids": [1, 2]}, r"list of InputFeature dicts, got dict"),
        ([{"input_ids": [1]}, {"input_ids": []}], r"features\[1\]\.input_ids is empty"),
        ([{"input_ids": [1, 2], "labels": [-100]}], r"features\[0\]\.labels has length 1 but input_ids has length 2"),
        ([{"input_ids": [1, -3]}], r"features\[0\]\.input_ids contains negative ids"),
        ([{"input_ids": [1]}, {"labels": [1]}], r"features\[1\] has no 'input_ids'"),
        ([{"input_ids": [4, 5, 6], "labels": [5, 6, -100]}], r"features\[0\]\.labels\[0\]=5 but input_ids\[0\]=4"),
        ([{"input_ids": [4, 5], "loss_mask": [0, 2]}], r"features\[0\]\.loss_mask\[1\]=2"),
        ([{"input_ids": [4, 5], "attention_mask": [1, 3]}], r"features\[0\]\.attention_mask\[1\]=3"),
    ],
)
def test_bad_features_name_the_offender(features, message, padding_free):
    with pytest.raises(InvalidInputError, match=message):
        InputProcessor(padding_free=padding_free)(features)


@pytest.mark.parametrize("padding_free", [False, True])
def test_max_length_names_index_and_length(padding_free):
    processor = InputProcessor(padding_free=padding_free, max_length=4)
    assert processor([{"input_ids": [1, 2, 3, 4]}])["seq_lens"].tolist() == [4]
    with pytest.raises(InvalidInputError, match=r"features\[1\] has 5 tokens, more than max_length=4"):
        processor([{"input_ids": [1]}, {"input_ids": [1, 2, 3, 4, 5]}])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"padding_side": "middle"}, r"padding_side must be 'right' or 'left', got 'middle'"),
        ({"max_length": 0}, r"max_length must be a positive int or None, got 0"),
        ({"pad_token_id": None}, r"pad_token_id must be a non-negative int, got None"),
        ({"device_mesh": DeviceMesh.from_sizes(world_size=2, cp_size=2)}, r"context parallelism \(device_mesh cp=2\)"),
    ],
)
def test_bad_configuration(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        InputProcessor(**kwargs)


def test_resolves_by_name_and_entry_point():
    processor = build("processor", "InputProcessor", padding_free=True)
    (entry_point,) = entry_points(group="twinkle.processor", name="InputProcessor")

    assert entry_point.load() is InputProcessor

    assert isinstance(processor, InputProcessor)
    assert processor.padding_free
