"""Putting per-sample loss inputs (advantages, sampler or reference log-probs) onto a batch's token layout.

Loss inputs arrive as one entry per sample, in the order of the batch's
samples. An entry is either

- a scalar (e.g. a sequence's advantage), which applies to every token of the sample, or
- a list of per-token values of one of two lengths:
  the sample's number of supervised tokens (its ``loss_mask == 1`` positions, in
  order — e.g. a sampler's log-probs of the completion), or the sample's full
  length (position ``t`` aligned with ``labels[t]`` — e.g. a reference model's
  ``forward_only`` log-probs).

The batch may be padded (``[B, T]``, either side) or packed (``[1, ΣT]``): each
sample's tokens are found through ``seq_starts``/``seq_lens`` as the collator
writes them. Without ``seq_starts``, a packed row's samples follow ``seq_lens``
back to back and each padded row holds one right-padded sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.data_format import ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.loss.reduction import token_weights


def model_logps(inputs: Mapping[str, Any], outputs: ModelOutput, loss_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``outputs.logps`` and the token weights (in the logps' dtype and device), both ``[B, T]``, checked to match."""
    logps_BT = outputs.logps
    if logps_BT is None:
        raise InvalidInputError(f"{loss_name} needs per-token logps in the model output")
    weights_BT = token_weights(inputs)
    if tuple(logps_BT.shape) != tuple(weights_BT.shape):
        raise InvalidInputError(
            f"outputs.logps has shape {tuple(logps_BT.shape)} but the batch's tokens are {tuple(weights_BT.shape)}"
        )
    return logps_BT, weights_BT.to(dtype=logps_BT.dtype, device=logps_BT.device)


def supervised_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    """Boolean ``[B, T]``: the tokens that are trained (``loss_mask``, else positive ``loss_weights``)."""
    mask = inputs.get("loss_mask")
    return token_weights(inputs) > 0 if mask is None else mask > 0


def sample_spans(inputs: Mapping[str, Any], shape: torch.Size) -> list[tuple[int, int]]:
    """``(start, length)`` of each sample in the flattened ``[B * T]`` token axis, in sample order."""
    batch, row_length = shape
    seq_lens = inputs.get("seq_lens")
    lengths = None if seq_lens is None else torch.as_tensor(seq_lens).tolist()
    seq_starts = inputs.get("seq_starts")
    if seq_starts is not None and lengths is not None:
        starts = torch.as_tensor(seq_starts).tolist()
    elif lengths is not None and batch == 1:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
    else:
        starts = [row * row_length for row in range(batch)]
        lengths = lengths or [row_length] * batch
    spans = list(zip(starts, lengths, strict=True))
    if any(start < 0 or start + length > batch * row_length for start, length in spans):
        raise InvalidInputError(f"seq_starts/seq_lens {spans} do not fit a batch of shape {tuple(shape)}")
    return spans


def per_token(
    values: Any,
    inputs: Mapping[str, Any],
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``values`` (one entry per sample, see the module docstring) laid out as ``[B, T]``; 0 off the samples.

    A scalar entry fills its whole sample; a supervised-length list fills the
    supervised positions and leaves the others 0. Raises
    :class:`InvalidInputError` naming ``name`` and the sample for a wrong count,
    a wrong length, or a NaN/inf value.
    """
    mask_BT = supervised_mask(inputs)
    spans = sample_spans(inputs, mask_BT.shape)
    mask_N = mask_BT.reshape(-1).cpu()
    values_N = torch.zeros(mask_N.numel(), dtype=torch.float64)
    for index, (entry, (start, length)) in enumerate(zip(sample_entries(values, len(spans), name), spans, strict=True)):
        values_N[start : start + length] = _spread(entry, mask_N[start : start + length], name, index)
    return values_N.view(mask_BT.shape).to(dtype=dtype, device=device or mask_BT.device)


def per_sequence(
    values: Any,
    inputs: Mapping[str, Any],
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """One value per sample, ``[S]``: scalar entries as they are, per-token lists summed over the trained tokens.

    The sum weighs each token like the loss does (``loss_weights`` or
    ``loss_mask``), so a list of per-token log-probs becomes the same sequence
    log-probability the loss computes from the model's own ``logps``.
    """
    weights_BT = token_weights(inputs)
    spans = sample_spans(inputs, weights_BT.shape)
    mask_N = supervised_mask(inputs).reshape(-1).cpu()
    weights_N = weights_BT.reshape(-1).cpu().double()
    sums = []
    for index, (entry, (start, length)) in enumerate(zip(sample_entries(values, len(spans), name), spans, strict=True)):
        if entry.dim() == 0:
            sums.append(entry)
        else:
            window = slice(start, start + length)
            sums.append((_spread(entry, mask_N[window], name, index) * weights_N[window]).sum())
    return torch.stack(sums).to(dtype=dtype, device=device or weights_BT.device)


def sample_entries(values: Any, count: int, name: str) -> list[torch.Tensor]:
    """``values`` as ``count`` finite float64 tensors, each a scalar or a 1-D list."""
    if getattr(values, "ndim", None) == 0:  # a 0-d array or tensor, whose len() raises TypeError
        raise InvalidInputError(f"{name} must have one entry per sample ({count}), got a 0-d {type(values).__name__}")
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
        raise InvalidInputError(f"{name} must have one entry per sample ({count}), got {type(values).__name__}")
    if len(values) != count:
        raise InvalidInputError(f"{name} has {len(values)} entries but the batch has {count} samples")
    entries = []
    for index, value in enumerate(values):
        try:
            entry = torch.as_tensor(value.detach() if torch.is_tensor(value) else value, dtype=torch.float64).cpu()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidInputError(f"{name}[{index}] is not a number or a list of numbers: {exc}") from exc
        if entry.dim() > 1:
            raise InvalidInputError(f"{name}[{index}] must be a number or a flat list, got shape {tuple(entry.shape)}")
        flat = entry.reshape(-1)
        bad = (~torch.isfinite(flat)).nonzero()
        if bad.numel():
            position = int(bad[0])
            raise InvalidInputError(f"{name}[{index}] holds {float(flat[position])} at position {position}")
        entries.append(entry)
    return entries


def _spread(entry: torch.Tensor, mask_L: torch.Tensor, name: str, index: int) -> torch.Tensor:
    """One sample's entry over its ``L`` tokens."""
    if entry.dim() == 0:
        return entry.expand(mask_L.numel())
    if entry.numel() == mask_L.numel():
        return entry
    supervised = int(mask_L.sum())
    if entry.numel() != supervised:
        raise InvalidInputError(
            f"{name}[{index}] has {entry.numel()} values, but sample {index} has {supervised} supervised tokens "
            f"(give one value per supervised token, or {mask_L.numel()} for every token of the sample)"
        )
    spread_L = torch.zeros(mask_L.numel(), dtype=entry.dtype)
    spread_L[mask_L] = entry
    return spread_L
