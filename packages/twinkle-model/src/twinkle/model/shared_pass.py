"""``forward_backward_many``: several adapters' batches in one forward and one backward.

The rows of every request are concatenated into one padded batch; each row
runs through the base model with its own adapter (``adapter_rows``). Each
request's loss sees only its own rows, with its own loss inputs and
normaliser, so its gradients equal those of a ``forward_backward`` of that
request alone. The per-request losses are summed and back-propagated once:
adapters share no trainable tensor and rows do not interact, so every adapter
receives exactly its own gradient.

A request that fails — bad inputs, its loss raising, a non-finite loss — is
dropped from the sum and its adapter's gradients are put back as they were;
the other requests go on unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from twinkle.data_format import InputFeature, ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.model.batching import GradGuard
from twinkle.model.microbatch import (
    check_loss_inputs,
    check_micro_batch_size,
    check_pairs_stay_whole,
    slice_loss_inputs,
)
from twinkle.model.token_logps import TokenLogpsResult, causal_token_logps, merge_token_counts
from twinkle.model.train_state import TrainState
from twinkle.model.training_metric import combine_loss_metrics
from twinkle.module import adapter_rows
from twinkle.processor import InputProcessor, select_rows, unpack

if TYPE_CHECKING:
    from twinkle.model.multi_lora_model import MultiLoraModel


@dataclass
class AdapterRequest:
    """One adapter's share of a shared pass: its inputs and the keyword inputs of its loss."""

    adapter_name: str
    inputs: Any
    loss_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class AdapterResult:
    """What one request got: its ``forward_backward`` output, or the error that stopped it."""

    adapter_name: str | None
    output: ModelOutput | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Plan:
    """A validated request and what its rows produced so far."""

    result: AdapterResult
    state: TrainState
    features: list[InputFeature]
    loss_inputs: dict[str, Any]
    normalizer: float | None
    guard: GradGuard
    loss: float = 0.0
    logps: list[torch.Tensor] = field(default_factory=list)
    counts: list[TokenLogpsResult] = field(default_factory=list)
    loss_metrics: list[tuple[Mapping[str, float], int]] = field(default_factory=list)


def forward_backward_many(
    owner: MultiLoraModel, requests: Sequence[AdapterRequest | Mapping[str, Any]], micro_batch_size: int | None
) -> list[AdapterResult]:
    check_micro_batch_size(micro_batch_size)
    results: list[AdapterResult] = []
    plans: list[_Plan] = []
    for index, request in enumerate(requests):
        result = AdapterResult(_adapter_name(request))
        results.append(result)
        try:
            plans.append(_plan(owner, request, index, result, {plan.state.name for plan in plans}, micro_batch_size))
        except Exception as exc:  # reported to this request only
            result.error = exc
    if not plans:
        return results
    processor = InputProcessor(padding_side="right", pad_token_id=owner.pad_token_id)
    start = time.perf_counter()
    for plan in plans:
        plan.guard.save()
    for part in _micro_batches(plans, micro_batch_size):
        part = [(plan, row) for plan, row in part if plan.result.error is None]
        if part:
            _shared_step(owner, processor, part)
    elapsed = time.perf_counter() - start
    total_tokens = sum(len(feature["input_ids"]) for plan in plans for feature in plan.features)
    for plan in plans:
        _finish(owner, plan, elapsed, total_tokens)
    return results


def _micro_batches(plans: list[_Plan], micro_batch_size: int | None) -> list[list[tuple[_Plan, int]]]:
    """Rows grouped into passes of at most ``micro_batch_size`` rows.

    Each request is cut exactly as ``forward_backward`` would cut it alone
    (chunks of ``micro_batch_size`` from its first row), and chunks are packed
    whole; a pairwise loss's request is never cut (see ``check_pairs_stay_whole``).
    """
    if micro_batch_size is None:
        return [[(plan, row) for plan in plans for row in range(len(plan.features))]]
    passes: list[list[tuple[_Plan, int]]] = [[]]
    for plan in plans:
        for first in range(0, len(plan.features), micro_batch_size):
            chunk = [(plan, row) for row in range(first, min(first + micro_batch_size, len(plan.features)))]
            if len(passes[-1]) + len(chunk) > micro_batch_size:
                passes.append([])
            passes[-1].extend(chunk)
    return passes


def _adapter_name(request: Any) -> str | None:
    name = request.get("adapter_name") if isinstance(request, Mapping) else getattr(request, "adapter_name", None)
    return name if isinstance(name, str) else None


def _plan(
    owner: MultiLoraModel,
    request: Any,
    index: int,
    result: AdapterResult,
    taken: set[str],
    micro_batch_size: int | None,
) -> _Plan:
    """Validate one request completely before anything runs."""
    if isinstance(request, Mapping):
        request = AdapterRequest(**request)
    if not isinstance(request, AdapterRequest):
        raise InvalidInputError(f"requests[{index}] must be an AdapterRequest or a dict, got {type(request).__name__}")
    if not isinstance(request.adapter_name, str):
        raise InvalidInputError(f"requests[{index}].adapter_name must name an adapter, got {request.adapter_name!r}")
    if request.adapter_name in taken:
        raise InvalidInputError(
            f"adapter {request.adapter_name!r} appears in more than one request: merge its batches into one"
        )
    state = owner._state(request.adapter_name)
    features = owner._batches.features(state, request.inputs)
    loss_inputs = dict(request.loss_inputs)
    check_loss_inputs(loss_inputs, len(features))
    check_pairs_stay_whole(state.loss, len(features), micro_batch_size)
    normalizer = state.loss.normalizer(owner._batches.collate(state, features))
    return _Plan(result, state, features, loss_inputs, normalizer, GradGuard(state.params))


def _shared_step(owner: MultiLoraModel, processor: InputProcessor, part: list[tuple[_Plan, int]]) -> None:
    """Forward the rows of ``part`` once, then back-propagate the sum of their requests' losses."""
    batch = processor([plan.features[row] for plan, row in part])
    device_batch = {name: tensor.to(owner.device) for name, tensor in batch.items()}
    with owner._autocast(), adapter_rows(owner.model, [plan.state.name for plan, _ in part]):
        result = causal_token_logps(owner.model, device_batch, owner.logps_chunk_size)
    positions: dict[int, list[int]] = {}
    for position, (plan, _) in enumerate(part):
        positions.setdefault(id(plan), []).append(position)
    total: torch.Tensor | None = None
    for plan_positions in positions.values():
        plan, first_row = part[plan_positions[0]]
        loss = _request_loss(owner, plan, device_batch, result, plan_positions, first_row)
        if loss is not None:
            total = loss if total is None else total + loss
    if total is None:
        return
    try:
        total.backward()
    except Exception as exc:  # every request in this pass failed together
        for plan, _ in part:
            plan.result.error = plan.result.error or exc


def _request_loss(
    owner: MultiLoraModel,
    plan: _Plan,
    batch: Mapping[str, torch.Tensor],
    result: TokenLogpsResult,
    positions: list[int],
    first_row: int,
) -> torch.Tensor | None:
    """This request's (scaled) loss on its rows of the shared batch, or ``None`` once it failed."""
    rows = torch.tensor(positions, device=owner.device)
    sub_batch = select_rows(batch, rows)
    sub_result = TokenLogpsResult(
        *(tensor.index_select(0, rows) for tensor in (result.logps_BT, result.correct_BT, result.supervised_BT))
    )
    size = len(plan.features)
    loss_inputs = slice_loss_inputs(plan.loss_inputs, size, first_row, first_row + len(positions))
    weight = None if plan.normalizer is not None else len(positions) / size
    output = ModelOutput(logps=sub_result.logps_BT, num_tokens=int(sub_result.supervised_BT.sum()))
    try:
        loss_output = owner._compute_loss(plan.state, sub_batch, output, plan.normalizer, loss_inputs, weight)
    except Exception as exc:  # reported to this request only
        plan.result.error = exc
        return None
    plan.loss += float(loss_output.loss.detach())
    plan.logps.extend(t.detach().cpu() for t in unpack(sub_result.logps_BT, sub_batch))
    plan.counts.append(sub_result)
    plan.loss_metrics.append((loss_output.metrics, int(sub_result.supervised_BT.sum())))
    return loss_output.loss / plan.state.gradient_accumulation_steps


def _finish(owner: MultiLoraModel, plan: _Plan, elapsed: float, total_tokens: int) -> None:
    """Restore a failed request's gradients, or count the step and report its output and metrics."""
    if plan.result.error is not None:
        plan.guard.restore()
        return
    state = plan.state
    state.accumulated += 1
    seq_lens = torch.tensor([len(feature["input_ids"]) for feature in plan.features])
    metrics = combine_loss_metrics(plan.loss_metrics)
    counts = merge_token_counts(plan.counts)
    share = int(seq_lens.sum()) / total_tokens  # each request is charged its share of the pass's time
    state.train_metric.record_step({"seq_lens": seq_lens}, counts, plan.loss, elapsed * share, metrics)
    supervised = int(counts.supervised_BT.sum())
    plan.result.output = ModelOutput(loss=plan.loss, logps=plan.logps, num_tokens=supervised, metrics=metrics)
