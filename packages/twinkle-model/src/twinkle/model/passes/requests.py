"""What a pass computes, per request: a registered loss on features, or a caller's loss on explicit targets.

- :class:`AdapterRequest`: ``InputFeature`` s (or trajectories) and the keyword
  inputs of the adapter's registered ``Loss`` (what ``forward_backward`` takes).
- :class:`TargetsRequest`: sequences in Tinker's layout (:class:`TargetSequence`:
  ``tokens[t]`` predicts ``targets[t]``, any id, one or K per position) and a
  ``LossFn`` over their log-probs (Tinker's losses, or a user's), or none to
  read the log-probs only.

Any mix of them runs through :class:`twinkle.model.passes.PassEngine`; each
request gets an :class:`AdapterResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.data_format import ModelOutput
from twinkle.errors import InvalidInputError

LossFn = Callable[[list[torch.Tensor]], tuple[torch.Tensor, Mapping[str, float]]]
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass
class AdapterRequest:
    """One adapter's ``forward_backward`` in a shared pass: its inputs and the keyword inputs of its loss.

    Without ``backward`` it is the adapter's ``forward_only``: log-probs (and the loss when it can be computed)
    in eval mode under no_grad, its gradients untouched.
    """

    adapter_name: str
    inputs: Any
    loss_inputs: dict[str, Any] = field(default_factory=dict)
    backward: bool = True


@dataclass
class TargetSequence:
    """One sequence in Tinker's layout: ``tokens[t]`` predicts ``targets[t]`` (``[N]`` or ``[N, K]``).

    ``features`` are the sequence's other model inputs as an ``InputFeature`` holds them: a vision-language
    model's ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (one per token).
    """

    tokens: torch.Tensor  # long [N]
    targets: torch.Tensor  # long [N] or [N, K]
    features: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class TargetsRequest:
    """One adapter's log-probs of explicit targets, and (with ``backward``) a training step on ``loss_fn``.

    ``loss_fn(logps)`` gets one float32 tensor per sequence, shaped like its
    targets and differentiable, and returns ``(loss, metrics)``. Without
    ``backward`` it runs in eval mode under no_grad (``loss_fn`` optional).
    """

    adapter_name: str | None
    sequences: Sequence[TargetSequence]
    loss_fn: LossFn | None = None
    backward: bool = True


PassRequest = AdapterRequest | TargetsRequest  # anything a shared pass takes


@dataclass
class TargetsOutput:
    """Per-sequence log-probs (detached, CPU, float32, shaped like the targets), the loss and its metrics."""

    logps: list[torch.Tensor]
    loss: float | None
    metrics: dict[str, float]


@dataclass
class AdapterResult:
    """What one request got: its output (``ModelOutput`` or ``TargetsOutput``), or the error that stopped it."""

    adapter_name: str | None
    output: ModelOutput | TargetsOutput | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> ModelOutput | TargetsOutput:
        """The output, or the request's error raised."""
        if self.error is not None:
            raise self.error
        assert self.output is not None  # a request without an error always has its output
        return self.output


def model_limits(model: Any) -> tuple[int, int | None]:
    """``(vocab_size, max_length)``: ids must index both embedding tables; no limit if the config has none.

    ``model`` is a transformers causal LM, possibly PEFT-wrapped.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = inner.get_output_embeddings()
    # out_features: a vocabulary-parallel head holds only its rows of the weight
    vocab_size = min(inner.get_input_embeddings().num_embeddings, getattr(head, "out_features", head.weight.shape[0]))
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


def checked_loss_fn_result(
    loss_fn: LossFn, logps: list[torch.Tensor], backward: bool
) -> tuple[torch.Tensor, dict[str, float]]:
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
