"""One adapter's forward calls: ``forward`` → ``calculate_loss`` → ``backward``, ``forward_backward``, ``forward_only``.

The :class:`TrainingModel` methods of the same names pick the adapter's
:class:`TrainState` and delegate here; ``state.pending`` carries the last
``forward`` (and its loss) over to ``calculate_loss`` and ``backward``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.model.batching import GradGuard
from twinkle.model.microbatch import check_loss_inputs, micro_batches
from twinkle.model.token_logps import TokenLogpsResult, causal_token_logps, merge_token_counts
from twinkle.model.train_state import TrainState
from twinkle.model.training_metric import token_weighted_mean
from twinkle.processor import unpack

if TYPE_CHECKING:
    from twinkle.model.training_model import TrainingModel


def forward(owner: TrainingModel, state: TrainState, inputs: Any) -> ModelOutput:
    batch = owner._batches.prepare(state, inputs)
    start = time.perf_counter()
    result = _run(owner, state, batch)
    output = _model_output(result, detach=False)
    state.pending = (batch, result, output, None, time.perf_counter() - start)
    return output


def calculate_loss(owner: TrainingModel, state: TrainState, loss_inputs: Mapping[str, Any]) -> LossOutput:
    if state.pending is None:
        raise InvalidInputError("calculate_loss needs a preceding forward(...) call")
    batch, result, output, _, seconds = state.pending
    check_loss_inputs(loss_inputs, len(batch["seq_lens"]))
    loss_output = owner._compute_loss(state, batch, output, None, loss_inputs)
    state.pending = (batch, result, output, loss_output, seconds)
    return loss_output


def backward(state: TrainState) -> None:
    if state.pending is None or state.pending[3] is None:
        raise InvalidInputError("backward needs forward(...) and calculate_loss(...) first")
    batch, result, _, loss_output, seconds = state.pending
    state.pending = None
    start = time.perf_counter()
    (loss_output.loss / state.gradient_accumulation_steps).backward()
    state.accumulated += 1
    state.train_metric.record_step(
        batch, result, float(loss_output.loss.detach()), seconds + time.perf_counter() - start
    )


def forward_backward(
    owner: TrainingModel,
    state: TrainState,
    inputs: Any,
    micro_batch_size: int | None,
    loss_inputs: Mapping[str, Any],
) -> ModelOutput:
    features = owner._batches.features(state, inputs)
    check_loss_inputs(loss_inputs, len(features))
    full_batch = owner._batches.collate(state, features)
    normalizer = state.loss.normalizer(full_batch)
    start = time.perf_counter()
    total_loss, logps, results, loss_metrics = 0.0, [], [], []
    with GradGuard(state.params):
        for part, part_inputs in micro_batches(features, loss_inputs, micro_batch_size):
            batch = full_batch if len(part) == len(features) else owner._batches.collate(state, part)
            result = _run(owner, state, batch)
            output = _model_output(result, detach=False)
            weight = None if normalizer is not None else len(part) / len(features)
            loss_output = owner._compute_loss(state, batch, output, normalizer, part_inputs, weight)
            (loss_output.loss / state.gradient_accumulation_steps).backward()
            total_loss += float(loss_output.loss.detach())
            logps.extend(t.detach().cpu() for t in unpack(result.logps_BT, batch))
            results.append(result)
            loss_metrics.append((loss_output.metrics, int(result.supervised_BT.sum())))
    state.accumulated += 1
    metrics = token_weighted_mean(loss_metrics)
    elapsed = time.perf_counter() - start
    state.train_metric.record_step(full_batch, merge_token_counts(results), total_loss, elapsed, metrics)
    supervised = sum(int(r.supervised_BT.sum()) for r in results)
    return ModelOutput(loss=total_loss, logps=logps, num_tokens=supervised, metrics=metrics)


def forward_only(
    owner: TrainingModel, state: TrainState, inputs: Any, return_logits: bool, loss_inputs: Mapping[str, Any]
) -> ModelOutput:
    batch = owner._batches.prepare(state, inputs)
    start = time.perf_counter()
    owner.model.eval()
    try:
        with torch.no_grad():
            result = _run(owner, state, batch, return_logits)
            output = _model_output(result, detach=True)
            required = getattr(state.loss, "required_inputs", ())
            if bool(result.supervised_BT.any()) and all(name in loss_inputs for name in required):
                loss_output = owner._compute_loss(state, batch, output, None, loss_inputs)
                output.loss, output.metrics = float(loss_output.loss), dict(loss_output.metrics)
    finally:
        owner.model.train()
    state.eval_metric.record_step(batch, result, output.loss, time.perf_counter() - start, output.metrics)
    output.logps = [t.cpu() for t in unpack(result.logps_BT, batch)]
    if return_logits:
        output.logits = [t.cpu() for t in unpack(result.logits_BTV, batch)]
    return output


def _run(
    owner: TrainingModel, state: TrainState, batch: Mapping[str, torch.Tensor], return_logits: bool = False
) -> TokenLogpsResult:
    batch = {k: v.to(owner.device) for k, v in batch.items()}
    with owner._autocast(), owner._adapter_scope(state, batch_size=batch["input_ids"].shape[0]):
        return causal_token_logps(owner.model, batch, owner.logps_chunk_size, return_logits)


def _model_output(result: TokenLogpsResult, detach: bool) -> ModelOutput:
    logps = result.logps_BT.detach() if detach else result.logps_BT
    return ModelOutput(logps=logps, num_tokens=int(result.supervised_BT.sum()))
