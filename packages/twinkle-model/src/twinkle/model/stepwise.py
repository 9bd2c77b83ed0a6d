"""One adapter's fine-grained calls: ``forward`` → ``calculate_loss`` → ``backward``, and ``generate``.

The :class:`TrainingModel` methods of the same names pick the adapter's
:class:`TrainState` and delegate here; ``state.pending`` carries the last
``forward`` (and its loss) over to ``calculate_loss`` and ``backward``. The
forward is the pass engine's (:meth:`PassEngine.label_logps`); the fused
calls (``forward_backward``...) run whole plans through it instead.

Under data parallelism ``inputs`` are this rank's share of the global batch:
losses are normalised over the global batch (see :mod:`twinkle.model.parallel`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from twinkle.data_format import InputFeature, LossOutput, ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.model.features import BatchPreparer
from twinkle.model.parallel import Parallelism, global_denominator, record_call
from twinkle.model.passes.engine import PassEngine, RowRouter
from twinkle.model.passes.logps import TokenLogpsResult
from twinkle.model.passes.loss_inputs import check_loss_inputs, checked_loss
from twinkle.model.train_state import TrainState


@dataclass(frozen=True)
class StepHost:
    """The model's collaborators these calls use (the model already wrapped for data parallelism)."""

    engine: PassEngine
    parallel: Parallelism
    batches: BatchPreparer
    model: Any
    route: RowRouter
    pad_token_id: int


@dataclass
class _Pending:
    """The last ``forward`` (and, once computed, its loss), waiting for ``calculate_loss`` / ``backward``."""

    features: list[InputFeature]
    batch: dict[str, torch.Tensor]
    result: TokenLogpsResult
    output: ModelOutput
    seconds: float
    loss_output: LossOutput | None = None


def forward(host: StepHost, state: TrainState, inputs: Any) -> ModelOutput:
    features, batch = _prepare(host, state, inputs)
    start = time.perf_counter()
    result = host.engine.label_logps(state.name if state.is_adapter else None, batch)
    output = ModelOutput(logps=result.logps_BT, num_tokens=int(result.supervised_BT.sum()))
    state.pending = _Pending(features, batch, result, output, time.perf_counter() - start)
    return output


def calculate_loss(host: StepHost, state: TrainState, loss_inputs: Mapping[str, Any]) -> LossOutput:
    pending = state.pending
    if pending is None:
        raise InvalidInputError("calculate_loss needs a preceding forward(...) call")
    parallel = host.parallel
    with parallel.all_or_none():
        check_loss_inputs(loss_inputs, len(pending.features))
    denominator = global_denominator(parallel, state.loss, pending.features, pending.batch, state.processor)
    device = pending.result.logps_BT.device
    batch = {name: tensor.to(device) for name, tensor in pending.batch.items()}
    with parallel.all_or_none():
        pending.loss_output = checked_loss(
            state.loss,
            batch,
            pending.output,
            denominator.normalizer,
            loss_inputs,
            denominator.weight(len(pending.features)),
        )
    return pending.loss_output


def backward(host: StepHost, state: TrainState) -> None:
    pending = state.pending
    if pending is None or pending.loss_output is None:
        raise InvalidInputError("backward needs forward(...) and calculate_loss(...) first")
    state.pending = None
    start = time.perf_counter()
    rows = [state.name if state.is_adapter else None] * int(pending.batch["input_ids"].shape[0])
    with host.route(rows, pending.batch):  # checkpointed layers recompute their forward with the adapter it used
        host.parallel.gradient_share(pending.loss_output.loss, state.gradient_accumulation_steps).backward()
    state.accumulated += 1
    seconds = pending.seconds + time.perf_counter() - start
    loss = float(pending.loss_output.loss.detach())
    record_call(host.parallel, state.train_metric, pending.batch, pending.result, loss, seconds)


def generate(host: StepHost, state: TrainState, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt (under FSDP every rank must call it with the same prompt)."""
    _, batch = _prepare(host, state, [{"input_ids": list(input_ids)}])
    model = host.model
    device = model.get_input_embeddings().weight.device
    model.eval()
    try:
        with torch.no_grad(), host.route([state.name if state.is_adapter else None], None):
            prompt = batch["input_ids"].to(device)
            output = host.parallel.run(
                model.generate,
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=host.pad_token_id,
            )
    finally:
        model.train()
    tokens: list[int] = output[0, prompt.shape[1] :].tolist()
    return tokens


def _prepare(host: StepHost, state: TrainState, inputs: Any) -> tuple[list[InputFeature], dict[str, torch.Tensor]]:
    """Validate and collate this rank's ``inputs``."""
    with host.parallel.all_or_none():
        features = host.batches.features(state, inputs)
        return features, state.processor(features)
