"""A validated request in a pass: its rows, its loss on what the pass computed for them, its output.

:class:`LossPlan` is a registered ``Loss`` over ``InputFeature`` s (the
``forward_backward`` / ``forward_only`` of one adapter); :class:`TargetsPlan`
a ``LossFn`` over explicit targets (Tinker's layout). Everything that can be
wrong with a request is checked when its plan is made, before any forward.
Each plan keeps its own normaliser, accumulation scale and metrics, so its
gradients and figures equal those of the request run alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from twinkle.data_format import InputFeature, ModelOutput
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model.parallel import Denominator, Parallelism, global_denominator, record_call
from twinkle.model.passes.grad_guard import GradGuard
from twinkle.model.passes.logps import TokenLogpsResult, merge_token_counts, sequence_batch
from twinkle.model.passes.loss_inputs import (
    check_loss_inputs,
    check_pairs_stay_whole,
    checked_loss,
    slice_loss_inputs,
)
from twinkle.model.passes.requests import (
    AdapterResult,
    LossFn,
    TargetSequence,
    TargetsOutput,
    check_sequences,
    checked_loss_fn_result,
)
from twinkle.model.train_state import TrainState
from twinkle.model.training_metric import combine_loss_metrics
from twinkle.processor import InputProcessor, unpack


@dataclass
class RowsView:
    """What the pass computed for one plan's rows ``first:first+count``.

    ``batch`` and ``labels`` are those rows' own (collated rows, label log-probs);
    ``targets`` the target log-probs of each of the rows, in order (target plans);
    ``router_aux`` their MoE router loss and its coefficient, when the model computes one
    (:mod:`twinkle.model.passes.router_aux`).
    """

    first: int
    count: int
    batch: Mapping[str, torch.Tensor]
    labels: TokenLogpsResult | None
    targets: list[torch.Tensor]
    router_aux: tuple[torch.Tensor, float] | None = None


class Plan(ABC):
    """One request in a pass. Subclasses say which rows it has and what its loss and output are."""

    reads_labels = False  # whether its loss reads the log-probs of the batch's labels
    return_logits = False  # whether its output includes the logits of its rows

    def __init__(self, state: TrainState, result: AdapterResult, train: bool) -> None:
        self.state, self.result, self.train = state, result, train
        self.guard = GradGuard(state.params)

    @property
    def failed(self) -> bool:
        return self.result.error is not None

    def fail(self, error: Exception) -> None:
        self.result.error = self.result.error or error

    @property
    @abstractmethod
    def row_count(self) -> int: ...

    @property
    @abstractmethod
    def token_count(self) -> int: ...

    @abstractmethod
    def chunks(self, micro_batch_size: int | None) -> list[tuple[int, int]]:
        """``(first, count)`` row ranges, each forwarded whole within one pass."""

    @abstractmethod
    def shared_features(self, first: int, count: int) -> list[InputFeature]:
        """The rows as features for a batch shared with other plans (right-padded by the engine)."""

    @abstractmethod
    def own_batch(self, first: int, count: int) -> dict[str, torch.Tensor]:
        """The rows collated as this request alone would be (its own processor)."""

    def target_rows(self, first: int, count: int) -> list[TargetSequence]:
        """The rows' explicit targets; none for a plan over labels."""
        return []

    @abstractmethod
    def loss(self, view: RowsView, parallel: Parallelism) -> torch.Tensor | None:
        """This plan's loss on ``view`` (recording its outputs); ``None`` when it computes none."""

    @abstractmethod
    def finish(self, seconds: float, parallel: Parallelism) -> None:
        """Count the call and make the output (not called for a failed plan)."""


class LossPlan(Plan):
    """``forward_backward`` (``train``) or ``forward_only`` of one adapter's features with its registered loss."""

    reads_labels = True

    def __init__(
        self,
        state: TrainState,
        result: AdapterResult,
        features: list[InputFeature],
        loss_inputs: Mapping[str, Any],
        parallel: Parallelism,
        train: bool,
        micro_batch_size: int | None = None,
        return_logits: bool = False,
    ) -> None:
        super().__init__(state, result, train)
        self.features, self.loss_inputs, self.return_logits = features, dict(loss_inputs), return_logits
        with parallel.all_or_none():
            if train:
                check_loss_inputs(self.loss_inputs, len(features))
                check_pairs_stay_whole(state.loss, len(features), micro_batch_size)
            self.full_batch: dict[str, torch.Tensor] = state.processor(features)
        self.denominator: Denominator | None = None
        if train:  # a forward_only computes it only once it knows the batch has labels
            self.denominator = self._denominator(parallel, micro_batch_size)
        self.loss_total: float | None = 0.0 if train else None
        self.logps: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.counts: list[TokenLogpsResult] = []
        self.loss_metrics: list[tuple[Mapping[str, float], int]] = []
        self.eval_metrics: dict[str, float] = {}

    @property
    def row_count(self) -> int:
        return len(self.features)

    @property
    def token_count(self) -> int:
        return sum(len(feature["input_ids"]) for feature in self.features)

    def chunks(self, micro_batch_size: int | None) -> list[tuple[int, int]]:
        step = self.row_count if micro_batch_size is None else micro_batch_size
        return [(first, min(step, self.row_count - first)) for first in range(0, self.row_count, step)]

    def shared_features(self, first: int, count: int) -> list[InputFeature]:
        return self.features[first : first + count]

    def own_batch(self, first: int, count: int) -> dict[str, torch.Tensor]:
        if count == self.row_count:
            return self.full_batch
        return dict(self.state.processor(self.features[first : first + count]))

    def loss(self, view: RowsView, parallel: Parallelism) -> torch.Tensor | None:
        assert view.labels is not None  # the engine computes label log-probs whenever a loss plan is in the pass
        labels = view.labels
        self.counts.append(labels)
        self.logps.extend(t.detach().cpu() for t in unpack(labels.logps_BT, view.batch))
        if labels.logits_BTV is not None:
            self.logits.extend(t.cpu() for t in unpack(labels.logits_BTV, view.batch))
        output = ModelOutput(logps=labels.logps_BT, num_tokens=int(labels.supervised_BT.sum()))
        if not self.train and not self._evaluates_loss(labels, parallel):
            return None
        denominator = self.denominator or self._denominator(parallel, None)
        self.denominator = denominator
        loss_inputs = slice_loss_inputs(self.loss_inputs, self.row_count, view.first, view.first + view.count)
        batch = {name: tensor.to(labels.logps_BT.device) for name, tensor in view.batch.items()}
        with parallel.all_or_none():  # a failing loss on any rank stops every rank before backward
            loss_output = checked_loss(
                self.state.loss, batch, output, denominator.normalizer, loss_inputs, denominator.weight(view.count)
            )
        value = float(loss_output.loss.detach())
        self.loss_total = value if self.loss_total is None else self.loss_total + value
        self.loss_metrics.append((loss_output.metrics, int(labels.supervised_BT.sum())))
        if not self.train or view.router_aux is None:
            return loss_output.loss
        aux, coef = view.router_aux
        self.loss_metrics.append(({"router_aux_loss": float(aux.detach())}, int(labels.supervised_BT.sum())))
        # The mean over micro-batches and ranks, like the loss: each rank's share scales by the ranks.
        weight = coef * view.count / self.row_count / parallel.data_world_size
        return loss_output.loss + weight * aux

    def finish(self, seconds: float, parallel: Parallelism) -> None:
        metric = self.state.train_metric if self.train else self.state.eval_metric
        weight = None if self.denominator is None else self.denominator.share
        loss, supervised, metrics = record_call(
            parallel,
            metric,
            self.full_batch,
            merge_token_counts(self.counts),
            self.loss_total,
            seconds,
            combine_loss_metrics(self.loss_metrics),
            weight,
        )
        output = ModelOutput(loss=loss, logps=self.logps, num_tokens=supervised, metrics=metrics)
        if self.logits:
            output.logits = self.logits
        self.result.output = output

    def _evaluates_loss(self, labels: TokenLogpsResult, parallel: Parallelism) -> bool:
        """A ``forward_only`` computes the loss when the batch has labels and every input the loss requires."""
        required = getattr(self.state.loss, "required_inputs", ())
        labelled = parallel.sum([float(labels.supervised_BT.any())])[0] > 0
        return labelled and all(name in self.loss_inputs for name in required)

    def _denominator(self, parallel: Parallelism, micro_batch_size: int | None) -> Denominator:
        state = self.state
        return global_denominator(
            parallel, state.loss, self.features, self.full_batch, state.processor, micro_batch_size
        )


class TargetsPlan(Plan):
    """Log-probs of explicit targets, ``loss_fn`` over them, and (``train``) its backward; never cut into parts."""

    def __init__(
        self,
        state: TrainState,
        result: AdapterResult,
        sequences: Sequence[TargetSequence],
        loss_fn: LossFn | None,
        train: bool,
        limits: tuple[int, int | None],
        parallel: Parallelism,
    ) -> None:
        super().__init__(state, result, train)
        if parallel.data_world_size > 1:  # a caller's loss over one rank's share has no global normaliser
            raise ConfigurationError(
                "forward_backward_targets runs in one process; under torchrun use forward_backward"
            )
        check_sequences(sequences, *limits)
        if loss_fn is not None and not callable(loss_fn):
            raise InvalidInputError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if train and loss_fn is None:
            raise InvalidInputError("forward_backward_targets with backward=True needs a loss_fn")
        self.sequences, self.loss_fn = list(sequences), loss_fn
        self.logps: list[torch.Tensor] = []
        self.loss_value: float | None = None
        self.metrics: dict[str, float] = {}

    @property
    def row_count(self) -> int:
        return len(self.sequences)

    @property
    def token_count(self) -> int:
        return sum(len(sequence.tokens) for sequence in self.sequences)

    def chunks(self, micro_batch_size: int | None) -> list[tuple[int, int]]:
        return [(0, self.row_count)]  # the caller's loss sees every sequence at once

    def shared_features(self, first: int, count: int) -> list[InputFeature]:
        sequences = self.sequences[first : first + count]
        return [cast(InputFeature, {"input_ids": s.tokens.tolist(), **s.features}) for s in sequences]

    def own_batch(self, first: int, count: int) -> dict[str, torch.Tensor]:
        sequences = self.sequences[first : first + count]
        if any(sequence.features for sequence in sequences):  # images: collated as a shared batch is
            return InputProcessor(padding_side="right", pad_token_id=0)(self.shared_features(first, count))
        return sequence_batch(sequences, 0)

    def target_rows(self, first: int, count: int) -> list[TargetSequence]:
        return self.sequences[first : first + count]

    def loss(self, view: RowsView, parallel: Parallelism) -> torch.Tensor | None:
        self.logps = [t.detach().float().cpu() for t in view.targets]
        if self.loss_fn is None:
            return None
        loss, self.metrics = checked_loss_fn_result(self.loss_fn, view.targets, self.train)
        self.loss_value = float(loss.detach())
        return loss

    def finish(self, seconds: float, parallel: Parallelism) -> None:
        metric = self.state.train_metric if self.train else self.state.eval_metric
        extra = {} if self.loss_value is None else {"loss": self.loss_value}
        metric.accumulate(tokens=self.token_count, seconds=seconds, loss_metrics=self.metrics, **extra)
        self.result.output = TargetsOutput(self.logps, self.loss_value, self.metrics)
