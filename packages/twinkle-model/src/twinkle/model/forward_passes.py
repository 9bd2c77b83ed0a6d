"""One adapter's forward calls: ``forward`` → ``calculate_loss`` → ``backward``, ``forward_backward``, ``forward_only``.

The :class:`TrainingModel` methods of the same names pick the adapter's
:class:`TrainState` and delegate here; ``state.pending`` carries the last
``forward`` (and its loss) over to ``calculate_loss`` and ``backward``.

Under data parallelism (``owner.parallel``) ``inputs`` are this rank's share
of the global batch: losses are normalised over the global batch and the
returned losses, token counts and metrics are the global batch's (see
:mod:`twinkle.model.global_batch`). Local checks run in ``all_or_none`` blocks,
so a bad share fails the call on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from twinkle.data_format import InputFeature, LossOutput, ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.model.batching import GradGuard
from twinkle.model.global_batch import Denominator, global_denominator, record_call
from twinkle.model.microbatch import check_loss_inputs, check_micro_batch_size, check_pairs_stay_whole, micro_batches
from twinkle.model.token_logps import TokenLogpsResult, causal_token_logps, merge_token_counts
from twinkle.model.train_state import TrainState
from twinkle.model.training_metric import combine_loss_metrics
from twinkle.processor import unpack

if TYPE_CHECKING:
    from twinkle.model.training_model import TrainingModel


@dataclass
class _Pending:
    """The last ``forward`` (and, once computed, its loss), waiting for ``calculate_loss`` / ``backward``."""

    features: list[InputFeature]
    batch: dict[str, torch.Tensor]
    result: TokenLogpsResult
    output: ModelOutput
    seconds: float
    loss_output: LossOutput | None = None


def forward(owner: TrainingModel, state: TrainState, inputs: Any) -> ModelOutput:
    features, batch = _prepare(owner, state, inputs)
    start = time.perf_counter()
    result = _run(owner, state, batch)
    output = _model_output(result, detach=False)
    state.pending = _Pending(features, batch, result, output, time.perf_counter() - start)
    return output


def calculate_loss(owner: TrainingModel, state: TrainState, loss_inputs: Mapping[str, Any]) -> LossOutput:
    pending = state.pending
    if pending is None:
        raise InvalidInputError("calculate_loss needs a preceding forward(...) call")
    with owner.parallel.all_or_none():
        check_loss_inputs(loss_inputs, len(pending.features))
    pending.loss_output, _ = _loss(owner, state, pending.features, pending.batch, pending.output, loss_inputs)
    return pending.loss_output


def backward(owner: TrainingModel, state: TrainState) -> None:
    pending = state.pending
    if pending is None or pending.loss_output is None:
        raise InvalidInputError("backward needs forward(...) and calculate_loss(...) first")
    state.pending = None
    start = time.perf_counter()
    owner.parallel.backward(pending.loss_output.loss, state.gradient_accumulation_steps)
    state.accumulated += 1
    seconds = pending.seconds + time.perf_counter() - start
    loss = float(pending.loss_output.loss.detach())
    record_call(owner.parallel, state.train_metric, pending.batch, pending.result, loss, seconds)


def forward_backward(
    owner: TrainingModel,
    state: TrainState,
    inputs: Any,
    micro_batch_size: int | None,
    loss_inputs: Mapping[str, Any],
) -> ModelOutput:
    features, full_batch = _prepare(owner, state, inputs, loss_inputs, micro_batch_size)
    collate = _collate(owner, state)
    denominator = global_denominator(owner.parallel, state.loss, features, full_batch, collate, micro_batch_size)
    start = time.perf_counter()
    total_loss = 0.0
    logps: list[torch.Tensor] = []
    results: list[TokenLogpsResult] = []
    loss_metrics: list[tuple[Mapping[str, float], int]] = []
    with GradGuard(state.params):
        for part, part_inputs in micro_batches(features, loss_inputs, micro_batch_size):
            batch = full_batch if len(part) == len(features) else collate(list(part))
            result = _run(owner, state, batch)
            output = _model_output(result, detach=False)
            with owner.parallel.all_or_none():  # a failing loss on any rank stops every rank before backward
                loss_output = owner._compute_loss(
                    state, batch, output, denominator.normalizer, part_inputs, denominator.weight(len(part))
                )
            owner.parallel.backward(loss_output.loss, state.gradient_accumulation_steps)
            total_loss += float(loss_output.loss.detach())
            logps.extend(t.detach().cpu() for t in unpack(result.logps_BT, batch))
            results.append(result)
            loss_metrics.append((loss_output.metrics, int(result.supervised_BT.sum())))
    state.accumulated += 1
    elapsed = time.perf_counter() - start
    loss, supervised, metrics = record_call(
        owner.parallel,
        state.train_metric,
        full_batch,
        merge_token_counts(results),
        total_loss,
        elapsed,
        combine_loss_metrics(loss_metrics),
        denominator.share,
    )
    return ModelOutput(loss=loss, logps=logps, num_tokens=supervised, metrics=metrics)


def forward_only(
    owner: TrainingModel, state: TrainState, inputs: Any, return_logits: bool, loss_inputs: Mapping[str, Any]
) -> ModelOutput:
    features, batch = _prepare(owner, state, inputs)
    start = time.perf_counter()
    loss, metrics_weight = None, None
    owner.model.eval()
    try:
        with torch.no_grad():
            result = _run(owner, state, batch, return_logits)
            output = _model_output(result, detach=True)
            required = getattr(state.loss, "required_inputs", ())
            labelled = owner.parallel.sum([float(result.supervised_BT.any())])[0] > 0
            if labelled and all(name in loss_inputs for name in required):
                loss_output, denominator = _loss(owner, state, features, batch, output, loss_inputs)
                loss, output.metrics = float(loss_output.loss), dict(loss_output.metrics)
                metrics_weight = denominator.share
    finally:
        owner.model.train()
    seconds = time.perf_counter() - start
    output.loss, output.num_tokens, output.metrics = record_call(
        owner.parallel, state.eval_metric, batch, result, loss, seconds, output.metrics, metrics_weight
    )
    output.logps = [t.cpu() for t in unpack(result.logps_BT, batch)]
    if result.logits_BTV is not None:  # present when asked for with return_logits
        output.logits = [t.cpu() for t in unpack(result.logits_BTV, batch)]
    return output


def generate(owner: TrainingModel, state: TrainState, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt (under FSDP every rank must call it with the same prompt)."""
    _, batch = _prepare(owner, state, [{"input_ids": list(input_ids)}])
    owner.model.eval()
    try:
        with torch.no_grad(), owner._adapter_scope(state, batch_size=1):
            prompt = batch["input_ids"].to(owner.device)
            output = owner.parallel.run(
                owner.model.generate,
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=owner.pad_token_id,
            )
    finally:
        owner.model.train()
    return output[0, prompt.shape[1] :].tolist()


def _prepare(
    owner: TrainingModel,
    state: TrainState,
    inputs: Any,
    loss_inputs: Mapping[str, Any] | None = None,
    micro_batch_size: int | None = None,
) -> tuple[list[InputFeature], dict[str, Any]]:
    """Wrap the model for data parallelism (on first use), then validate and collate this rank's ``inputs``."""
    owner.parallel.wrap(owner.model, owner._states.values())
    with owner.parallel.all_or_none():
        check_micro_batch_size(micro_batch_size)
        features = owner._batches.features(state, inputs)
        if loss_inputs is not None:
            check_loss_inputs(loss_inputs, len(features))
            check_pairs_stay_whole(state.loss, len(features), micro_batch_size)
        return features, owner._batches.collate(state, features)


def _collate(owner: TrainingModel, state: TrainState) -> Any:
    return lambda features: owner._batches.collate(state, features)


def _loss(
    owner: TrainingModel,
    state: TrainState,
    features: list[InputFeature],
    batch: dict[str, torch.Tensor],
    output: ModelOutput,
    loss_inputs: Mapping[str, Any],
) -> tuple[LossOutput, Denominator]:
    """This rank's share of the loss of one whole (not micro-) batch, normalised over the global batch."""
    denominator = global_denominator(owner.parallel, state.loss, features, batch, _collate(owner, state))
    with owner.parallel.all_or_none():
        loss_output = owner._compute_loss(
            state, batch, output, denominator.normalizer, loss_inputs, denominator.weight(len(features))
        )
    return loss_output, denominator


def _run(
    owner: TrainingModel, state: TrainState, batch: Mapping[str, torch.Tensor], return_logits: bool = False
) -> TokenLogpsResult:
    batch = {k: v.to(owner.device) for k, v in batch.items()}
    with owner._autocast(), owner._adapter_scope(state, batch_size=batch["input_ids"].shape[0]):
        return owner.parallel.run(causal_token_logps, owner.model, batch, owner.logps_chunk_size, return_logits)


def _model_output(result: TokenLogpsResult, detach: bool) -> ModelOutput:
    logps = result.logps_BT.detach() if detach else result.logps_BT
    return ModelOutput(logps=logps, num_tokens=int(result.supervised_BT.sum()))
