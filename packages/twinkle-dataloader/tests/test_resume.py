"""Checkpoint and resume: a resumed loader yields exactly the batches an uninterrupted one would."""

from __future__ import annotations

import json
from itertools import islice

import pytest

from twinkle.dataloader import DataLoader
from twinkle.errors import ConfigurationError, InvalidInputError

ROWS = list(range(23))  # batch_size 5: four full batches and a short one of 3 per epoch


def _loader(**kwargs) -> DataLoader:
    return DataLoader(ROWS, **{"batch_size": 5, "shuffle": True, "seed": 3, **kwargs})


def _uninterrupted(epochs: int) -> list[list[int]]:
    loader = _loader()
    return [list(batch) for _ in range(epochs) for batch in loader]


def _resumed(state: dict, epochs_left: int) -> list[list[int]]:
    loader = _loader()
    loader.load_state(json.loads(json.dumps(state)))  # as stored in a JSON checkpoint
    return [list(batch) for _ in range(epochs_left) for batch in loader]


def test_resume_mid_epoch():
    reference = _uninterrupted(2)
    loader = _loader()
    seen = [list(batch) for batch in islice(loader, 3)]
    state = loader.get_state()

    assert seen == reference[:3]
    assert state == {
        "epoch": 0,
        "batches_consumed": 3,
        "seed": 3,
        "dataset_length": 23,
        "batch_size": 5,
        "min_batch_size": 1,
        "shuffle": True,
    }
    assert _resumed(state, 2) == reference[3:]


def test_resume_across_and_at_epoch_boundaries():
    reference = _uninterrupted(3)
    loader = _loader()
    for _ in loader:  # a whole epoch
        pass
    at_boundary = loader.get_state()
    inside_second = [list(batch) for batch in islice(loader, 2)]
    mid_second = loader.get_state()

    assert inside_second == reference[5:7]
    assert _resumed(at_boundary, 2) == reference[5:]
    assert _resumed(mid_second, 2) == reference[7:]


def test_mismatched_state_is_refused_with_the_differences():
    state = _loader().get_state()
    with pytest.raises(ConfigurationError, match=r"dataset_length=23 \(this loader: 22\)"):
        DataLoader(ROWS[:-1], batch_size=5, shuffle=True).load_state(state)
    with pytest.raises(
        ConfigurationError, match=r"batch_size=5 \(this loader: 4\).*shuffle=True \(this loader: False\)"
    ):
        DataLoader(ROWS, batch_size=4).load_state(state)


def test_malformed_state_is_refused():
    state = _loader().get_state()
    with pytest.raises(InvalidInputError, match="missing"):
        _loader().load_state({k: v for k, v in state.items() if k != "epoch"})
    with pytest.raises(InvalidInputError, match="epoch must be int"):
        _loader().load_state({**state, "epoch": "1"})
    with pytest.raises(InvalidInputError, match="batches_consumed=9 exceeds the 5 batches"):
        _loader().load_state({**state, "batches_consumed": 9})
    with pytest.raises(InvalidInputError, match="from get_state"):
        _loader().load_state([1, 2])


def test_checkpoint_seed_wins():
    state = _loader(seed=11).get_state()
    loader = _loader(seed=3)
    loader.load_state(state)
    assert [list(b) for b in loader] == [list(b) for b in _loader(seed=11)]


def test_skip_consumed_samples_counts_rows_across_epochs():
    reference = _uninterrupted(2)
    loader = _loader()
    loader.skip_consumed_samples(23 + 10)  # one epoch, then two batches
    assert [list(batch) for batch in loader] == reference[7:]

    resumed = _loader()
    resumed.resume_from_checkpoint(10)
    assert [list(batch) for batch in resumed] == reference[2:5]

    with pytest.raises(InvalidInputError, match="stops inside a batch"):
        loader.skip_consumed_samples(7)
    assert loader.get_state()["batches_consumed"] == 5  # unchanged by the refused skip


def test_resume_from_checkpoint_accepts_a_state():
    loader = _loader()
    next(iter(loader))
    resumed = _loader()
    resumed.resume_from_checkpoint(loader.get_state())
    assert [list(b) for b in resumed] == [list(b) for b in loader]
