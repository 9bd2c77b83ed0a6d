"""The global-batch arithmetic of data parallelism, with ranks simulated by threads in one process.

Each thread plays one data-parallel rank holding its share of a batch; their
``sum`` meets at a barrier, like an all-reduce. The ranks' shares must add up
to what one process computes on the whole batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from twinkle.data_format import IGNORE_INDEX, ModelOutput
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.infra import DeviceMesh
from twinkle.interfaces import Loss
from twinkle.loss import CrossEntropyLoss, DPOLoss
from twinkle.model.multi_lora_model import MultiLoraModel
from twinkle.model.parallel import (
    Denominator,
    Parallelism,
    global_batch,
    global_denominator,
    parallelism_for,
    record_call,
)
from twinkle.model.passes.logps import TokenLogpsResult
from twinkle.model.training_metric import TrainingMetric, combine_loss_metrics
from twinkle.model.transformers_model import TransformersModel
from twinkle.processor import InputProcessor


class _ThreadRank(Parallelism):
    """One simulated rank: ``sum`` (``max``) combines every rank's values once all of them have arrived."""

    def __init__(self, rank: int, slots: list[Any], barrier: threading.Barrier) -> None:
        self.rank, self.slots, self.barrier = rank, slots, barrier
        self.data_world_size = len(slots)

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, sum)

    def max(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, max)

    def _all_reduce(self, values: Sequence[float], op: Callable[[Sequence[float]], float]) -> list[float]:
        self.slots[self.rank] = list(values)
        self.barrier.wait()
        combined = [op(column) for column in zip(*self.slots, strict=True)]
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return combined


def _on_ranks(fn: Callable[[Parallelism, Any], Any], shares: Sequence[Any]) -> list[Any]:
    """``fn(rank, share)`` for every share, concurrently, one thread per rank."""
    barrier = threading.Barrier(len(shares), timeout=30)
    slots: list[Any] = [None] * len(shares)
    with ThreadPoolExecutor(len(shares)) as pool:
        futures = [pool.submit(fn, _ThreadRank(i, slots, barrier), share) for i, share in enumerate(shares)]
        return [future.result() for future in futures]


def _features(lengths: Sequence[int], seed: int = 0) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    features = []
    for length in lengths:
        ids = torch.randint(0, 1000, (length,), generator=generator).tolist()
        features.append({"input_ids": ids, "labels": [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]})
    return features


COLLATE = InputProcessor()
LENGTHS = (6, 9, 12, 7, 10, 5, 8)  # 7 samples: shares of 4 and 3, with different token counts


def _shares(features: list, ranks: int = 2) -> list[list]:
    mesh = DeviceMesh.from_sizes(dp_size=ranks)
    return [features[mesh.get_slice(len(features), rank)] for rank in range(ranks)]


def _denominator(rank: Parallelism, share: list, loss: Loss, micro_batch_size: int | None = None) -> Denominator:
    return global_denominator(rank, loss, share, COLLATE(share), COLLATE, micro_batch_size)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "token_sum"])
def test_every_rank_gets_the_whole_batch_normaliser(reduction):
    loss = CrossEntropyLoss(reduction=reduction)
    features = _features(LENGTHS)
    shares = _shares(features)
    expected = [
        Denominator(loss.normalizer(COLLATE(features)), len(features), loss.normalizer(COLLATE(share)))
        for share in shares
    ]
    assert _on_ranks(lambda rank, share: _denominator(rank, share, loss), shares) == expected


def _logps(features: list[dict[str, Any]]) -> torch.Tensor:
    """Made-up per-token log-probs of a right-padded batch: each sample's depend on the sample alone."""
    rows = [
        -torch.rand(len(f["input_ids"]), generator=torch.Generator().manual_seed(f["input_ids"][0])) for f in features
    ]
    logps = torch.zeros(len(rows), max(len(row) for row in rows))
    for index, row in enumerate(rows):
        logps[index, : len(row)] = row
    return logps


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "token_sum"])
def test_rank_losses_add_up_to_the_whole_batch_loss(reduction):
    loss = CrossEntropyLoss(reduction=reduction)
    features = _features(LENGTHS)

    def share_loss(rank: Parallelism, share: list) -> float:
        normalizer = _denominator(rank, share, loss).normalizer
        return float(loss(COLLATE(share), ModelOutput(logps=_logps(share)), normalizer=normalizer).loss)

    expected = float(loss(COLLATE(features), ModelOutput(logps=_logps(features))).loss)
    assert sum(_on_ranks(share_loss, _shares(features))) == pytest.approx(expected, rel=1e-6)


def _as_pairs(pairs: list[tuple[dict, dict]]) -> list[dict]:
    """The preference layout: the chosen sequences, then their rejected ones in the same order."""
    return [chosen for chosen, _ in pairs] + [rejected for _, rejected in pairs]


def test_dpo_ranks_laying_out_their_own_pairs_add_up_to_the_whole_batch_loss():
    """Under torchrun the DataLoader gives each rank whole pair rows; each rank's loss is its share of the mean."""
    loss, features = DPOLoss(beta=0.5), _features(LENGTHS[:6] * 2)
    pairs = list(zip(features[:6], features[6:], strict=True))
    ref = {id(f): float(i) / 10 for i, f in enumerate(features)}  # a made-up reference log-prob per sequence

    def pair_loss(rank: Parallelism, share: list) -> float:
        layout = _as_pairs(share)
        normalizer = _denominator(rank, layout, loss).normalizer
        output = ModelOutput(logps=_logps(layout))
        return float(loss(COLLATE(layout), output, normalizer=normalizer, ref_logps=[ref[id(f)] for f in layout]).loss)

    whole = _as_pairs(pairs)
    expected = loss(COLLATE(whole), ModelOutput(logps=_logps(whole)), ref_logps=[ref[id(f)] for f in whole]).loss
    assert sum(_on_ranks(pair_loss, _shares(pairs))) == pytest.approx(float(expected), rel=1e-6)


def test_dpo_over_data_parallel_ray_workers_is_refused(monkeypatch):
    """The driver splits a Ray call's 2N sequences contiguously: worker 0 would get only chosen ones."""
    monkeypatch.setattr(global_batch, "get_runtime", lambda: SimpleNamespace(mode="ray_worker"))
    layout = _as_pairs(list(zip(_features(LENGTHS[:2]), _features(LENGTHS[2:4]), strict=True)))
    with pytest.raises(ConfigurationError, match=r"DPOLoss over data-parallel Ray workers: .* or use torchrun"):
        _on_ranks(lambda rank, share: _denominator(rank, share, DPOLoss()), [layout, layout])


class _MeanPerSample(Loss):
    """A loss that averages over its own samples (no normaliser)."""

    def __call__(self, inputs, outputs, **loss_inputs):
        raise NotImplementedError


class _SquareRootNormaliser(CrossEntropyLoss):
    def normalizer(self, inputs):
        return super().normalizer(inputs) ** 0.5


def test_losses_without_a_normaliser_weigh_parts_by_their_share_of_the_samples():
    denominators = _on_ranks(
        lambda rank, share: _denominator(rank, share, _MeanPerSample()), _shares(_features(LENGTHS))
    )
    assert denominators == [Denominator(None, 7, 4), Denominator(None, 7, 3)]
    assert [d.weight(n) for d, n in zip(denominators, (4, 3), strict=True)] == [4 / 7, 3 / 7]


def test_a_normaliser_that_neither_counts_nor_stays_constant_is_refused():
    with pytest.raises(ConfigurationError, match="neither a count over the batch nor a constant"):
        _on_ranks(lambda rank, share: _denominator(rank, share, _SquareRootNormaliser()), [_features(LENGTHS)] * 2)


def test_uneven_micro_batch_counts_are_refused_on_every_rank():
    features = _features(LENGTHS)  # shares of 4 and 3: 2 micro-batches of 2 each, but 4 and 3 of 1
    assert len(_on_ranks(lambda rank, share: _denominator(rank, share, CrossEntropyLoss(), 2), _shares(features))) == 2

    def uneven(rank: Parallelism, share: list) -> str:
        with pytest.raises(InvalidInputError, match="different numbers of micro-batches"):
            _denominator(rank, share, CrossEntropyLoss(), 1)
        return "raised"

    assert _on_ranks(uneven, _shares(features)) == ["raised", "raised"]


def _result(supervised: list[bool], correct: list[bool]) -> TokenLogpsResult:
    mask = torch.tensor([supervised])
    return TokenLogpsResult(torch.zeros(mask.shape), torch.tensor([correct]), mask)


def test_recorded_figures_are_the_global_batch_s():
    shares = [  # (loss share, supervised, correct, tokens, a loss metric)
        (1.5, [True, True, True], [True, False, False], 5, {"clip": 0.2}),
        (0.5, [True, False, False], [True, False, False], 3, {"clip": 0.6}),
    ]

    def record(rank: Parallelism, share: tuple) -> tuple:
        loss, supervised, correct, tokens, metrics = share
        metric = TrainingMetric()
        batch = {"seq_lens": torch.tensor([tokens])}
        returned = record_call(rank, metric, batch, _result(supervised, correct), loss, 0.5, metrics)
        return returned, metric.calculate()

    (returned, figures), other = _on_ranks(record, shares)
    assert other == (returned, figures)  # every rank reports the same global figures
    assert returned == (2.0, 4, {"clip": pytest.approx((0.2 * 3 + 0.6 * 1) / 4)})
    assert figures["loss"] == 2.0 and figures["num_supervised_tokens"] == 4 and figures["num_tokens"] == 8
    assert figures["accuracy"] == 0.5 and figures["tokens_per_second"] == 16


def test_loss_metrics_are_averaged_with_the_ranks_shares_of_the_normaliser():
    """A preference loss's accuracy over ranks holding 3 and 1 pairs is the global share of pairs ranked right."""

    def record(rank: Parallelism, share: tuple) -> dict:
        pairs, accuracy = share
        batch = {"seq_lens": torch.tensor([4])}
        result = _result([True] * 7, [True] * 7)  # many tokens per pair: token weights would be wrong here
        return record_call(rank, TrainingMetric(), batch, result, 0.1, 0.5, {"accuracy": accuracy}, pairs)[2]

    assert _on_ranks(record, [(3, 2 / 3), (1, 0.0)]) == [{"accuracy": pytest.approx(0.5)}] * 2


def test_maxima_among_the_loss_metrics_take_the_largest_value_everywhere():
    """``*_max`` metrics combine by max over micro-batches, ranks and calls; the others by their means."""
    assert combine_loss_metrics([({"x": 1.0, "gap_max": 0.5}, 1), ({"x": 4.0, "gap_max": 0.25}, 3)]) == {
        "x": 3.25,
        "gap_max": 0.5,
    }

    def record(rank: Parallelism, gap: float) -> dict:
        batch = {"seq_lens": torch.tensor([4])}
        return record_call(rank, TrainingMetric(), batch, _result([True], [True]), 0.1, 0.5, {"gap_max": gap})[2]

    assert _on_ranks(record, [0.125, 0.75]) == [{"gap_max": 0.75}] * 2
    metric = TrainingMetric()
    for gap in (0.5, 2.0, 1.0):
        metric.accumulate(loss_metrics={"gap_max": gap, "x": gap})
    assert metric.calculate() == {"loss/gap_max": 2.0, "loss/x": pytest.approx(7 / 6)}


def test_one_process_records_its_own_figures_unchanged():
    metric = TrainingMetric()
    batch = {"seq_lens": torch.tensor([4])}
    returned = record_call(Parallelism(), metric, batch, _result([True, True], [True, False]), 0.75, 1.0, {"x": 0.3})
    assert returned == (0.75, 2, {"x": 0.3})


def test_one_process_gradient_share_divides_by_the_accumulation_steps_only():
    weight = torch.tensor(3.0, requires_grad=True)
    Parallelism().gradient_share(weight * 2.0, gradient_accumulation_steps=4).backward()
    assert weight.grad == 0.5


def test_meshes_that_cannot_train_here_are_refused_before_loading_anything():
    assert type(parallelism_for(None, torch.device("cpu"), TransformersModel)) is Parallelism
    assert type(parallelism_for(DeviceMesh.from_sizes(), torch.device("cpu"), TransformersModel)) is Parallelism
    with pytest.raises(
        ConfigurationError, match=r"dp_size/fsdp_size/ep_size/ulysses_size only; this mesh also has \{'tp': 2\}"
    ):
        parallelism_for(DeviceMesh.from_sizes(dp_size=2, tp_size=2), torch.device("cpu"), TransformersModel)
    with pytest.raises(ConfigurationError, match="spans 2 ranks but this is one of 1 processes: launch with torchrun"):
        TransformersModel(device="cpu", device_mesh=DeviceMesh.from_sizes(dp_size=2))
    with pytest.raises(ConfigurationError, match="MultiLoraModel runs in one process"):
        MultiLoraModel(device="cpu", device_mesh=DeviceMesh.from_sizes(fsdp_size=2))
