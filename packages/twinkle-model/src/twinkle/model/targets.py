"""Log-probabilities of caller-chosen target ids (Tinker's datum layout), and a training step over them.

A Tinker datum pairs input ``tokens`` (``[N]``) with targets of shape ``[N]``
(``tokens[t]`` predicts ``targets[t]``, any id, not necessarily ``tokens[t+1]``)
or ``[N, K]`` (K ids per position, for top-K distillation). Twinkle's
``InputFeature`` shifts its own labels instead, so these sequences get their
own path: one decoder pass over the right-padded batch, then the output layer
on the real positions only and in chunks, so ``[T, V]`` logits never all exist.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model.batching import GradGuard
from twinkle.model.token_logps import output_layer_logps
from twinkle.model.train_state import TrainState
from twinkle.processor import model_inputs

if TYPE_CHECKING:
    from twinkle.model.training_model import TrainingModel

LossFn = Callable[[list[torch.Tensor]], tuple[torch.Tensor, Mapping[str, float]]]
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass
class TargetSequence:
    """One sequence in Tinker's layout: ``tokens[t]`` predicts ``targets[t]`` (``[N]`` or ``[N, K]``)."""

    tokens: torch.Tensor  # long [N]
    targets: torch.Tensor  # long [N] or [N, K]


@dataclass
class TargetsOutput:
    """Per-sequence log-probs (detached, CPU, float32, shaped like the targets), the loss and its metrics."""

    logps: list[torch.Tensor]
    loss: float | None
    metrics: dict[str, float]


def target_logps(
    model: torch.nn.Module, sequences: Sequence[TargetSequence], chunk_size: int = 4096
) -> list[torch.Tensor]:
    """``log p(targets[t] | tokens[:t+1])`` per sequence, float32 with autograd, shaped like each ``targets``.

    ``model`` is a transformers causal LM, possibly PEFT-wrapped; the output layer
    runs over ``chunk_size`` positions at a time.
    """
    check_sequences(sequences, *model_limits(model))
    return _target_logps(model, sequences, chunk_size)


def model_limits(model: torch.nn.Module) -> tuple[int, int | None]:
    """``(vocab_size, max_length)``: ids must index both embedding tables; no limit if the config has none."""
    inner = _inner(model)
    vocab_size = min(inner.get_input_embeddings().num_embeddings, inner.get_output_embeddings().weight.shape[0])
    return vocab_size, getattr(inner.config, "max_position_embeddings", None)


def check_sequences(sequences: Any, vocab_size: int, max_length: int | None, label: str = "sequences") -> None:
    """Raise :class:`InvalidInputError` naming the first bad sequence (as ``label[i]``), before anything runs."""
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence) or not sequences:
        raise InvalidInputError("sequences must be a non-empty list of TargetSequence")
    for index, sequence in enumerate(sequences):
        where = f"{label}[{index}]"
        if not isinstance(sequence, TargetSequence):
            raise InvalidInputError(f"{where} must be a TargetSequence, got {type(sequence).__name__}")
        tokens, targets = sequence.tokens, sequence.targets
        for name, tensor in (("tokens", tokens), ("targets", targets)):
            if not torch.is_tensor(tensor) or tensor.dtype not in _INTEGER_DTYPES:
                kind = tensor.dtype if torch.is_tensor(tensor) else type(tensor).__name__
                raise InvalidInputError(f"{where}.{name} must be an integer tensor, got {kind}")
        if tokens.dim() != 1:
            raise InvalidInputError(f"{where}.tokens must be 1-D [N], got shape {list(tokens.shape)}")
        if tokens.numel() == 0:
            raise InvalidInputError(f"{where}.tokens is empty")
        if targets.dim() not in (1, 2):
            raise InvalidInputError(f"{where}.targets must be [N] or [N, K], got shape {list(targets.shape)}")
        if targets.shape[0] != tokens.shape[0]:
            raise InvalidInputError(
                f"{where}.targets has {targets.shape[0]} positions but tokens has {tokens.shape[0]}"
            )
        if targets.dim() == 2 and targets.shape[1] == 0:
            raise InvalidInputError(f"{where}.targets has K = 0 targets per position")
        if max_length is not None and tokens.shape[0] > max_length:
            raise InvalidInputError(
                f"{where} has {tokens.shape[0]} tokens, more than the model's {max_length} positions"
            )
        for name, tensor in (("tokens", tokens), ("targets", targets)):
            low, high = int(tensor.min()), int(tensor.max())
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                raise InvalidInputError(f"{where}.{name} has id {bad}, outside the vocabulary [0, {vocab_size})")


def run_targets(
    owner: TrainingModel,
    state: TrainState,
    sequences: Sequence[TargetSequence],
    loss_fn: LossFn | None,
    backward: bool,
) -> TargetsOutput:
    """``TrainingModel.forward_backward_targets``: validate, forward, loss and (optionally) backward."""
    if owner.parallel.data_world_size > 1:  # a caller's loss over one rank's share has no global normaliser
        raise ConfigurationError("forward_backward_targets runs in one process; under torchrun use forward_backward")
    check_sequences(sequences, *model_limits(owner.model))
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidInputError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if backward and loss_fn is None:
        raise InvalidInputError("forward_backward_targets with backward=True needs a loss_fn")
    start = time.perf_counter()
    if backward:
        with GradGuard(state.params):
            logps, loss, metrics = _pass(owner, state, sequences, loss_fn, backward=True)
        state.accumulated += 1
    else:
        owner.model.eval()
        try:
            with torch.no_grad():
                logps, loss, metrics = _pass(owner, state, sequences, loss_fn, backward=False)
        finally:
            owner.model.train()
    record = state.train_metric if backward else state.eval_metric
    tokens = sum(len(sequence.tokens) for sequence in sequences)
    extra = {} if loss is None else {"loss": loss}
    record.accumulate(tokens=tokens, seconds=time.perf_counter() - start, loss_metrics=metrics, **extra)
    return TargetsOutput([t.detach().float().cpu() for t in logps], loss, metrics)


def _pass(
    owner: TrainingModel,
    state: TrainState,
    sequences: Sequence[TargetSequence],
    loss_fn: LossFn | None,
    backward: bool,
) -> tuple[list[torch.Tensor], float | None, dict[str, float]]:
    # Loss and backward stay inside the adapter scope: checkpointed chunks recompute there.
    with owner._adapter_scope(state, batch_size=len(sequences)):
        with owner._autocast():
            logps = _target_logps(owner.model, sequences, owner.logps_chunk_size, owner.device)
        if loss_fn is None:
            return logps, None, {}
        loss, metrics = _checked_loss(loss_fn, logps, backward)
        if backward:
            (loss / state.gradient_accumulation_steps).backward()
    return logps, float(loss.detach()), metrics


def _checked_loss(loss_fn: LossFn, logps: list[torch.Tensor], backward: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss_fn(logps)`` as a finite scalar tensor (that reaches the logps when backward is wanted)."""
    result = loss_fn(logps)
    if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[1], Mapping):
        raise InvalidInputError("loss_fn must return (loss, metrics): a scalar tensor and a dict of floats")
    loss, metrics = result
    if not torch.is_tensor(loss) or loss.dim() != 0:
        raise InvalidInputError("loss_fn must return a scalar tensor as its loss")
    if not bool(torch.isfinite(loss)):
        raise InvalidInputError(f"loss_fn returned a non-finite loss ({float(loss.detach())}); nothing was applied")
    if backward and not loss.requires_grad:
        raise InvalidInputError("loss_fn's loss does not depend on the log-probs, so it has no gradient")
    try:
        floats = {str(name): float(value) for name, value in metrics.items()}
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"loss_fn's metrics must be numbers: {exc}") from exc
    return loss, floats


def _inner(model: Any) -> Any:  # a transformers model, possibly PEFT-wrapped
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _target_logps(
    model: torch.nn.Module,
    sequences: Sequence[TargetSequence],
    chunk_size: int,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """:func:`target_logps` on sequences already checked."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")
    inner = _inner(model)
    device = device or inner.get_input_embeddings().weight.device
    lengths = [len(sequence.tokens) for sequence in sequences]
    widths = [1 if s.targets.dim() == 1 else s.targets.shape[1] for s in sequences]
    batch_size, length, width = len(sequences), max(lengths), max(widths)
    input_ids_BT = torch.zeros(batch_size, length, dtype=torch.long)
    mask_BT = torch.zeros(batch_size, length, dtype=torch.long)
    # Sequences with fewer targets per position are padded with id 0, gathered and then dropped.
    targets_NK = torch.zeros(sum(lengths), width, dtype=torch.long)
    offset = 0
    for row, (sequence, n, k) in enumerate(zip(sequences, lengths, widths, strict=True)):
        input_ids_BT[row, :n] = sequence.tokens
        mask_BT[row, :n] = 1
        targets_NK[offset : offset + n, :k] = sequence.targets.reshape(n, k)
        offset += n
    batch = {
        "input_ids": input_ids_BT.to(device),
        "attention_mask": mask_BT.to(device),
        "position_ids": torch.arange(length, device=device).expand(batch_size, length),
    }
    hidden_BTH = inner.get_decoder()(**model_inputs(batch)).last_hidden_state
    # Row-major boolean indexing keeps each sequence's positions together and in order.
    real_BT = batch["attention_mask"].bool()
    rows_N = real_BT.nonzero(as_tuple=True)[0]  # the sequence of each position, for a per-row adapted head
    head = inner.get_output_embeddings()
    logps_NK = output_layer_logps(head, hidden_BTH[real_BT], targets_NK.to(device), rows_N, chunk_size).logps
    pieces = logps_NK.split(lengths)
    return [piece[:, :k].reshape(s.targets.shape) for piece, k, s in zip(pieces, widths, sequences, strict=True)]


def set_hyperparameters(optimizer: torch.optim.Optimizer, hyperparameters: Mapping[str, Any]) -> None:
    """Set ``hyperparameters`` on every param group in place (state kept); unknown keys are rejected first."""
    for key, value in hyperparameters.items():
        if key == "params" or any(key not in group for group in optimizer.param_groups):
            known = sorted(k for k in optimizer.param_groups[0] if k != "params")
            raise InvalidInputError(f"{type(optimizer).__name__} has no hyper-parameter {key!r}; known: {known}")
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "lr" and not (is_number and 0 <= value < math.inf):
            raise InvalidInputError(f"lr must be a finite number >= 0, got {value!r}")
    for group in optimizer.param_groups:
        group.update(hyperparameters)
