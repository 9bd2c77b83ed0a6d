"""Batches, epochs, shuffling, processors and argument checks."""

from __future__ import annotations

import pytest

from twinkle.dataloader import DataLoader
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.registry import register


def _epoch(loader: DataLoader) -> list[list[int]]:
    return [list(batch) for batch in loader]


def test_batches_cover_the_dataset_in_order():
    loader = DataLoader(list(range(10)), batch_size=4)
    assert len(loader) == 3
    assert _epoch(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"min_batch_size": 2}, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),
        ({"min_batch_size": 3}, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ({"drop_last": True}, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ({"drop_last": True, "min_batch_size": 4}, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_last_short_batch_needs_min_batch_size(kwargs, expected):
    loader = DataLoader(list(range(10)), batch_size=4, **kwargs)
    assert _epoch(loader) == expected
    assert len(loader) == len(expected)


def test_each_loop_is_an_epoch_reshuffled_from_seed_and_epoch():
    loader = DataLoader(list(range(12)), batch_size=5, shuffle=True, seed=7)
    epochs = [[row for batch in loader for row in batch] for _ in range(3)]

    assert all(sorted(order) == list(range(12)) for order in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert loader.epoch == 2
    twin = DataLoader(list(range(12)), batch_size=5, shuffle=True, seed=7)
    twin.set_epoch(2)
    assert [row for batch in twin for row in batch] == epochs[2]
    other_seed = DataLoader(list(range(12)), batch_size=5, shuffle=True, seed=8)
    assert [row for batch in other_seed for row in batch] != epochs[0]


def test_without_shuffle_every_epoch_has_the_same_order():
    loader = DataLoader(list(range(5)), batch_size=2)
    assert _epoch(loader) == _epoch(loader) == [[0, 1], [2, 3], [4]]


def test_dataset_may_be_built_by_a_callable():
    loader = DataLoader(dataset=lambda: [{"x": i} for i in range(3)], batch_size=2)
    assert _epoch(loader) == [[{"x": 0}, {"x": 1}], [{"x": 2}]]


class _ArrowLike:
    """A dataset that reads several rows at once, like ``twinkle.dataset.Dataset``."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        raise AssertionError("rows should be read in batches")

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.calls.append(indices)
        return [i * 10 for i in indices]


def test_batches_are_read_in_one_call_when_the_dataset_supports_it():
    dataset = _ArrowLike(5)
    assert _epoch(DataLoader(dataset, batch_size=3)) == [[0, 10, 20], [30, 40]]
    assert dataset.calls == [[0, 1, 2], [3, 4]]


class _Collate:
    def __call__(self, rows):
        return {"rows": len(rows), "total": sum(rows)}


def test_processor_collates_each_batch():
    register("processor", _Collate, name="TestCollate")
    for processor in (_Collate(), _Collate, "TestCollate"):
        loader = DataLoader(list(range(5)), batch_size=2, processor=processor)
        assert list(loader) == [{"rows": 2, "total": 1}, {"rows": 2, "total": 5}, {"rows": 1, "total": 4}]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ConfigurationError, "batch_size must be an int >= 1, got 0"),
        ({"batch_size": True}, ConfigurationError, "batch_size must be an int >= 1"),
        ({"batch_size": 4, "min_batch_size": 5}, ConfigurationError, "min_batch_size=5 exceeds batch_size=4"),
        ({"batch_size": 4, "min_batch_size": 0}, ConfigurationError, "min_batch_size must be an int >= 1"),
        ({"batch_size": 4, "min_batch_size": 2, "drop_last": True}, ConfigurationError, "contradicts min_batch_size=2"),
        ({"batch_size": 4, "seed": "x"}, ConfigurationError, "seed must be an int"),
        ({"batch_size": 20, "drop_last": True}, InvalidInputError, "10 rows yields no batch of at least 20 rows"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        DataLoader(list(range(10)), **kwargs)


def test_bad_datasets_are_named():
    with pytest.raises(InvalidInputError, match="empty dataset"):
        DataLoader([], batch_size=1)
    with pytest.raises(ConfigurationError, match=r"__len__ and __getitem__.*got generator"):
        DataLoader((i for i in range(3)), batch_size=1)
    with pytest.raises(InvalidInputError, match="non-negative int"):
        DataLoader([1], batch_size=1).set_epoch(-1)
