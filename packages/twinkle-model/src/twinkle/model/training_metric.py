"""The built-in metric every adapter reports: loss, token accuracy, grad norm, lr, tokens/s."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.interfaces import Metric


class TrainingMetric(Metric):
    """Accumulates per-call figures between two ``calculate_metric`` calls.

    ``loss`` is the mean of the calls' losses; ``accuracy`` is over all
    supervised tokens (argmax equals the label); ``tokens_per_second`` counts
    every input token over the time spent in forward/backward.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._loss_sum = 0.0
        self._calls = 0
        self._correct = 0
        self._supervised = 0
        self._tokens = 0
        self._seconds = 0.0
        self._grad_norm: float | None = None
        self._lr: float | None = None
        self._loss_metric_sums: dict[str, float] = {}
        self._loss_metric_calls: dict[str, int] = {}
        self._loss_metric_maxima: dict[str, float] = {}

    def accumulate(self, **values: Any) -> None:
        """Keys: ``loss``, ``correct_tokens``, ``supervised_tokens``, ``tokens``, ``seconds``, ``grad_norm``, ``lr``,
        and ``loss_metrics``: a loss's own scalars (e.g. clip fractions), averaged over calls (maxima, named
        ``*_max``, by their largest value) and reported as ``loss/<name>``."""
        if "loss" in values:
            self._loss_sum += float(values["loss"])
            self._calls += 1
        self._correct += int(values.get("correct_tokens", 0))
        self._supervised += int(values.get("supervised_tokens", 0))
        self._tokens += int(values.get("tokens", 0))
        self._seconds += float(values.get("seconds", 0.0))
        if values.get("grad_norm") is not None:
            self._grad_norm = float(values["grad_norm"])
        if values.get("lr") is not None:
            self._lr = float(values["lr"])
        for name, value in (values.get("loss_metrics") or {}).items():
            if is_maximum(name):
                self._loss_metric_maxima[name] = max(self._loss_metric_maxima.get(name, -math.inf), float(value))
            else:
                self._loss_metric_sums[name] = self._loss_metric_sums.get(name, 0.0) + float(value)
                self._loss_metric_calls[name] = self._loss_metric_calls.get(name, 0) + 1

    def calculate(self) -> dict[str, float]:
        result: dict[str, float] = {}
        if self._calls:
            result["loss"] = self._loss_sum / self._calls
        if self._supervised:
            result["accuracy"] = self._correct / self._supervised
            result["num_supervised_tokens"] = float(self._supervised)
        if self._tokens:
            result["num_tokens"] = float(self._tokens)
            if self._seconds > 0:
                result["tokens_per_second"] = self._tokens / self._seconds
        if self._grad_norm is not None and math.isfinite(self._grad_norm):
            result["grad_norm"] = self._grad_norm
        if self._lr is not None:
            result["lr"] = self._lr
        for name, total in self._loss_metric_sums.items():  # namespaced: a loss may report its own "accuracy"
            result[f"loss/{name}"] = total / self._loss_metric_calls[name]
        for name, largest in self._loss_metric_maxima.items():
            result[f"loss/{name}"] = largest
        return result


def is_maximum(name: str) -> bool:
    """A loss metric named ``*_max`` is a maximum: it combines by ``max``, never by averaging."""
    return name.endswith("_max")


def combine_loss_metrics(parts: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """Combine micro-batches' loss metrics: maxima by ``max``, the others weighted by their supervised tokens."""
    totals: dict[str, float] = {}
    weights: dict[str, int] = {}
    maxima: dict[str, float] = {}
    for metrics, tokens in parts:
        for name, value in metrics.items():
            if is_maximum(name):
                maxima[name] = max(maxima.get(name, -math.inf), float(value))
                continue
            totals[name] = totals.get(name, 0.0) + float(value) * tokens
            weights[name] = weights.get(name, 0) + tokens
    return {**{name: totals[name] / weights[name] for name in totals if weights[name]}, **maxima}
