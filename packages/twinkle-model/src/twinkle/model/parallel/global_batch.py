"""The global batch's figures from every data-parallel rank's share: the loss normaliser and the recorded metrics.

Under data parallelism each rank holds a slice of the global batch. A
token-mean loss over the whole batch is ``Σ_all w·x / N`` with ``N`` the
*global* number of supervised tokens; if every rank divides its own ``Σ w·x``
by that same ``N``, the ranks' losses (and their gradients) add up exactly to
the one-process loss (and gradient) of the whole batch. So:

- :func:`global_denominator` all-reduces the loss's normaliser (and the sample
  count, for losses that average over their own samples);
- the wrappers average gradients over ranks, which ``Parallelism.gradient_share``
  undoes by scaling each share by the number of ranks;
- :func:`record_call` sums the ranks' figures (their losses, token counts)
  so the returned loss and every metric describe the global batch.

A normaliser adds up over parts of a batch when it counts something (tokens,
sequences, pairs) and stays the same when it is a constant (``token_sum``'s
1). Which one a loss has is probed on the batch repeated twice; any other
normaliser cannot be split over ranks and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.infra import get_runtime
from twinkle.interfaces import Loss
from twinkle.model.parallel.plans import Parallelism
from twinkle.model.passes.logps import TokenLogpsResult
from twinkle.model.training_metric import TrainingMetric, is_maximum

Collate = Callable[[list[Any]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class Denominator:
    """The global batch's loss ``normalizer`` (``None``: the loss averages over its own samples) and sample count.

    ``share`` is this rank's own part of it (its normaliser, else its samples): the weight of its loss metrics
    in their average over ranks, so that, e.g., a preference loss's accuracy is the global share of pairs.
    """

    normalizer: float | None
    samples: int
    share: float

    def weight(self, part_samples: int) -> float | None:
        """The factor for a part's loss when there is no normaliser: its share of the global batch's samples."""
        return None if self.normalizer is not None else part_samples / self.samples


def global_denominator(
    parallel: Parallelism,
    loss: Loss,
    features: Sequence[Any],
    batch: Mapping[str, torch.Tensor],
    collate: Collate,
    micro_batch_size: int | None = None,
) -> Denominator:
    """The denominator of the global batch, of which ``features`` (collated: ``batch``) are this rank's share.

    Under data parallelism every rank must split its share into the same number
    of micro-batches (each is a forward with collectives); that is checked here too.
    """
    if parallel.data_world_size == 1:
        normalizer = loss.normalizer(batch)
        return Denominator(normalizer, len(features), len(features) if normalizer is None else normalizer)
    if getattr(loss, "pairwise", False) and get_runtime().mode == "ray_worker":
        raise ConfigurationError(
            f"{type(loss).__name__} over data-parallel Ray workers: the driver splits a call's 2N sequences "
            "contiguously, which would separate pairs; give the model one worker (dp_size=1) or use torchrun"
        )
    with parallel.all_or_none():
        normalizer = loss.normalizer(batch)
        additive = normalizer is None or _adds_up(loss, normalizer, features, collate)
        micro = 1 if micro_batch_size is None else math.ceil(len(features) / micro_batch_size)
    # Equal micro-batch counts on every rank <=> ranks · Σ m² == (Σ m)² (one sum instead of a min and a max).
    total, samples, additive_ranks, micro_sum, micro_squares = parallel.sum(
        [normalizer or 0.0, len(features), float(additive), micro, micro * micro]
    )
    ranks = parallel.data_world_size
    if ranks * micro_squares != micro_sum * micro_sum:
        raise InvalidInputError(
            f"with micro_batch_size={micro_batch_size} the data-parallel ranks' shares of this batch split into "
            "different numbers of micro-batches; use a global batch size divisible by the ranks x micro_batch_size"
        )
    if normalizer is None:
        return Denominator(None, int(samples), len(features))
    if additive_ranks == ranks:
        return Denominator(total, int(samples), normalizer)
    if additive_ranks == 0:  # a constant: every rank has the same one
        return Denominator(total / ranks, int(samples), normalizer)
    raise ConfigurationError(f"{type(loss).__name__}'s normaliser adds up on some ranks and not on others")


def _adds_up(loss: Loss, normalizer: float, features: Sequence[Any], collate: Collate) -> bool:
    doubled = loss.normalizer(collate([*features, *features]))
    if doubled is not None:
        if math.isclose(doubled, 2 * normalizer):
            return True
        if math.isclose(doubled, normalizer):
            return False
    twice = "None" if doubled is None else f"{doubled:g}"
    raise ConfigurationError(
        f"{type(loss).__name__}.normalizer is neither a count over the batch nor a constant "
        f"({normalizer:g} for this rank's share, {twice} for it twice): it cannot be split over data-parallel ranks"
    )


def record_call(
    parallel: Parallelism,
    metric: TrainingMetric,
    batch: Mapping[str, torch.Tensor],
    result: TokenLogpsResult,
    loss: float | None,
    seconds: float,
    loss_metrics: Mapping[str, float] | None = None,
    metrics_weight: float | None = None,
) -> tuple[float | None, int, dict[str, float]]:
    """Add one call's figures, summed over the data-parallel ranks, to ``metric``.

    Returns the global batch's ``(loss, supervised tokens, loss metrics)``.

    ``loss`` is this rank's share of the global loss (``None`` when none was computed, on every rank).
    A loss's own metrics are averaged over ranks weighted by ``metrics_weight`` (``Denominator.share``),
    by default their supervised tokens; maxima (``*_max``) take the largest rank's value.
    """
    counts = {
        "correct_tokens": int(result.correct_BT.sum()),
        "supervised_tokens": int(result.supervised_BT.sum()),
        "tokens": int(batch["seq_lens"].sum()),
    }
    metrics = dict(loss_metrics or {})
    if parallel.data_world_size > 1:
        names = sorted(name for name in metrics if not is_maximum(name))
        maxima = sorted(name for name in metrics if is_maximum(name))  # the same names on every rank: one loss
        weight = counts["supervised_tokens"] if metrics_weight is None else metrics_weight
        weighted = [metrics[name] * weight for name in names]
        totals = parallel.sum([loss or 0.0, *counts.values(), weight, *weighted])
        largest = parallel.max([metrics[name] for name in maxima]) if maxima else []
        loss = None if loss is None else totals[0]
        counts = {key: int(value) for key, value in zip(counts, totals[1:4], strict=True)}
        weights = totals[4]
        metrics = {name: total / weights for name, total in zip(names, totals[5:], strict=True) if weights}
        metrics.update(zip(maxima, largest, strict=True))
    values: dict[str, Any] = {**counts, "seconds": seconds, "loss_metrics": metrics}
    if loss is not None:
        values["loss"] = loss
    metric.accumulate(**values)
    return loss, counts["supervised_tokens"], metrics
