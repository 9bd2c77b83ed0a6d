"""Tinker's built-in losses over the trainer's per-datum log-probs, checked in full before any model work.

Notation (tinker-protocol.md §3): ``lp`` = the trainer's log-prob of each
``target_tokens`` cell, ``q`` = the ``logprobs`` input (the sampler's),
``A`` = ``advantages``, ``w`` = ``weights`` (optional, all ones when absent),
``r = exp(lp − q)``, ``sg`` = stop-gradient. Every loss is a **sum** over
tokens and datums, never a mean:

- ``cross_entropy``: ``−Σ w·lp`` (targets ``[N]`` or ``[N, K]``; float weights
  are used as given, so ``forward_backward_custom``'s ``w = −dC/dlp`` works);
- ``importance_sampling``: ``−Σ w·r·A``;
- ``ppo``: ``−Σ w·min(r·A, clip(r, lo, hi)·A)``, default ``lo, hi = 0.8, 1.2``;
- ``cispo``: ``−Σ w·sg(clip(r, lo, hi))·lp·A``, default ``0.0, 4.0``;
- ``dro``: ``−Σ w·(lp·A − ½·beta·(lp − q)²)``, ``beta`` required;
- ``gspo`` (GSPO-token, Zheng et al. 2025): ``s = exp(Σ m·(lp − q) / Σ m)``
  per datum with ``m`` = ``sequence_ratio_mask``, ``r_t = sg(s)·exp(lp_t − sg(lp_t))``,
  ``−Σ w·min(r_t·A, clip(r_t, lo, hi)·A)``; default thresholds are the paper's
  ``lo, hi = 1 − 3e-4, 1 + 4e-4`` (Tinker publishes none).

The per-token terms are those of ``twinkle.loss`` (``CrossEntropyLoss``,
``ImportanceSamplingLoss``, ``PPOLoss``, ``CISPOLoss``, ``DROLoss`` and
``clipped_surrogate``), called on a batch built here rather than through their
``__call__``: that path treats only ``w > 0`` as trained and computes GSPO's
sequence ratio over ``w > 0`` instead of ``sequence_ratio_mask``, which differs
from Tinker's formulas for negative weights and for masks other than ``w > 0``.
As in ``twinkle.loss``, ``q`` is replaced by ``sg(lp)`` where ``w = 0``: those
terms are multiplied by 0 anyway, and a far-off ``q`` there cannot overflow a
ratio into ``inf · 0 = NaN``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from twinkle.data_format import ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.loss import (
    CISPOLoss,
    CrossEntropyLoss,
    DROLoss,
    ImportanceSamplingLoss,
    PolicyBatch,
    PolicyLoss,
    PPOLoss,
    clipped_surrogate,
    k3,
)
from twinkle.server.tinker.codec import Datum

LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
LossClosure = Callable[[list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]

_CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
DEFAULT_CLIP = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (1 - 3e-4, 1 + 4e-4)}
_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": _CLIP_KEYS,
    "cispo": _CLIP_KEYS,
    "dro": ("beta",),
    "gspo": _CLIP_KEYS,
}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": (*_RL_INPUTS, "sequence_ratio_mask"),
}
_UNSUPPORTED = {
    "stable_reinforce": "its algorithm is server-side and unpublished; use 'importance_sampling' (or 'ppo') instead",
    "custom": "server-side custom losses are off; use TrainingClient.forward_backward_custom, which runs the loss "
    "client-side",
}


@dataclass(frozen=True)
class _Params:
    """A loss's checked ``loss_fn_config``, defaults filled in."""

    clip: tuple[float, float] = (0.0, math.inf)  # (lo, hi) ratio thresholds
    beta: float = 0.0


def targets_of(datum: Datum, index: int) -> np.ndarray:
    """``target_tokens`` as int64 ``[N]`` or ``[N, K]`` with ``N = len(tokens)``; raises naming ``data[index]``."""
    where = f"data[{index}].loss_fn_inputs"
    targets = datum.loss_fn_inputs.get("target_tokens")
    if targets is None:
        raise InvalidInputError(f"{where}: missing 'target_tokens' (the token each position is trained to predict)")
    where += "['target_tokens']"
    if targets.dtype.kind not in "iu":
        raise InvalidInputError(f"{where}: must be integer token ids (int64), got {targets.dtype}")
    if targets.ndim not in (1, 2):
        raise InvalidInputError(f"{where}: must have shape [N] or [N, K], got {list(targets.shape)}")
    if targets.shape[0] != len(datum.tokens):
        raise InvalidInputError(
            f"{where}: has {targets.shape[0]} positions but model_input has {len(datum.tokens)} tokens "
            "(position t of model_input predicts target_tokens[t])"
        )
    if targets.ndim == 2 and targets.shape[1] == 0:
        raise InvalidInputError(f"{where}: has K = 0 targets per position")
    if targets.size and targets.min() < 0:
        raise InvalidInputError(f"{where}: holds the negative token id {int(targets.min())}")
    return targets.astype(np.int64, copy=False)


def build_loss(loss_fn: str, config: Mapping[str, float | str], data: Sequence[Datum]) -> LossClosure:
    """Check the loss name, its config and every datum's inputs; return ``lp -> (loss, metrics)``.

    The closure takes one float tensor per datum, shaped like its
    ``target_tokens`` (with autograd), and returns the scalar loss and metrics
    keyed ``name:reduction`` (always ``loss:sum``; RL losses add token means).
    """
    name = _checked_name(loss_fn)
    params = _checked_config(name, config)
    if not data:
        raise InvalidInputError("data is empty: forward_backward needs at least one datum")
    shapes: list[tuple[int, ...]] = []
    columns: dict[str, list[np.ndarray]] = {}
    for index, datum in enumerate(data):
        inputs = _checked_inputs(name, datum, index)
        shapes.append(tuple(inputs["target_tokens"].shape))
        for key, value in inputs.items():
            if key != "target_tokens":
                columns.setdefault(key, []).append(value.reshape(-1))
    # One [1, M] row of every datum's cells, in order: the losses are elementwise except GSPO's per-datum mean.
    flat = {key: torch.from_numpy(np.concatenate(parts)).unsqueeze(0) for key, parts in columns.items()}
    segments = torch.repeat_interleave(torch.arange(len(shapes)), torch.tensor([math.prod(s) for s in shapes]))
    policy = _policy(name, params)

    def loss_closure(lp: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        lp_BT = _flat_logps(lp, shapes)
        inputs = {key: value.to(device=lp_BT.device, dtype=lp_BT.dtype) for key, value in flat.items()}
        weights_BT = inputs["weights"]
        if name == "cross_entropy":
            output = CrossEntropyLoss("token_sum")({"loss_weights": weights_BT}, ModelOutput(logps=lp_BT), 1.0)
            return output.loss, {"loss:sum": float(output.loss.detach())}
        trained_BT = weights_BT != 0
        batch = PolicyBatch(
            inputs={},
            logps_BT=lp_BT,
            old_logps_BT=torch.where(trained_BT, inputs["logprobs"], lp_BT.detach()),
            advantages_BT=inputs["advantages"],
            mask_BT=trained_BT,
        )
        if name == "gspo":
            ratio_BT = _gspo_ratio(lp_BT, inputs["logprobs"], inputs["sequence_ratio_mask"], segments, len(shapes))
            values_BT, stats = clipped_surrogate(ratio_BT, batch, *params.clip)
        else:
            ratio_BT = torch.exp(batch.log_ratio_BT)
            assert policy is not None  # every RL loss but gspo has one
            values_BT, stats = policy.token_losses(batch)
        loss = (values_BT * weights_BT).sum()
        stats["ratio"] = batch.mean(ratio_BT)
        stats["approx_kl"] = batch.mean(k3(batch.log_ratio_BT.detach()))
        metrics = {f"{key}:mean": float(value) for key, value in stats.items()}
        metrics["loss:sum"] = float(loss.detach())
        return loss, metrics

    return loss_closure


def _checked_name(loss_fn: str) -> str:
    if loss_fn in LOSS_NAMES:
        return loss_fn
    if loss_fn in _UNSUPPORTED:
        raise InvalidInputError(f"loss_fn {loss_fn!r} is not supported by this server: {_UNSUPPORTED[loss_fn]}")
    raise InvalidInputError(f"unknown loss_fn {loss_fn!r}; this server supports {', '.join(LOSS_NAMES)}")


def _checked_config(name: str, config: Mapping[str, float | str]) -> _Params:
    if not isinstance(config, Mapping):
        raise InvalidInputError(f"loss_fn_config must be a mapping, got {type(config).__name__}")
    allowed = _CONFIG_KEYS[name]
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        raise InvalidInputError(f"loss_fn_config: {name} has no parameter {', '.join(map(repr, unknown))}; {takes}")
    values: dict[str, float] = {}
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInputError(f"loss_fn_config[{key!r}]: must be a finite number, got {value!r}")
        values[key] = float(value)
    if name == "dro":
        if "beta" not in values:
            raise InvalidInputError("loss_fn_config: dro needs 'beta' (the weight of ½·(lp − logprobs)²)")
        if values["beta"] < 0:
            raise InvalidInputError(f"loss_fn_config['beta']: must be >= 0, got {values['beta']}")
        return _Params(beta=values["beta"])
    if name not in DEFAULT_CLIP:
        return _Params()
    low = values.get("clip_low_threshold", DEFAULT_CLIP[name][0])
    high = values.get("clip_high_threshold", DEFAULT_CLIP[name][1])
    if low > high:
        raise InvalidInputError(f"loss_fn_config: clip_low_threshold ({low}) is above clip_high_threshold ({high})")
    # The twinkle losses clip to (1 − ε_low, 1 + ε_high) with ε_low in [0, 1] and ε_high >= 0.
    if not 0 <= low <= 1:
        raise InvalidInputError(f"loss_fn_config['clip_low_threshold']: must be in [0, 1], got {low}")
    if high < 1:
        raise InvalidInputError(f"loss_fn_config['clip_high_threshold']: must be >= 1, got {high}")
    return _Params(clip=(low, high))


def _checked_inputs(name: str, datum: Datum, index: int) -> dict[str, np.ndarray]:
    """The datum's targets and float inputs (float64, ``weights`` filled with ones), all shaped like the targets."""
    where = f"data[{index}].loss_fn_inputs"
    required = _REQUIRED_INPUTS[name]
    allowed = (*required, "weights")
    unknown = sorted(set(datum.loss_fn_inputs) - set(allowed))
    if unknown:
        hint = " (clip thresholds go in loss_fn_config)" if set(unknown) & set(_CLIP_KEYS) else ""
        raise InvalidInputError(
            f"{where}: {name} does not take {', '.join(map(repr, unknown))}{hint}; it takes {', '.join(allowed)}"
        )
    for key in required:
        if key not in datum.loss_fn_inputs:
            raise InvalidInputError(f"{where}: {name} needs {key!r}; it takes {', '.join(allowed)}")
    targets = targets_of(datum, index)
    inputs = {"target_tokens": targets}
    for key in allowed[1:]:
        value = datum.loss_fn_inputs.get(key)
        if value is None:  # only weights are optional
            inputs[key] = np.ones(targets.shape, dtype=np.float64)
            continue
        field = f"{where}[{key!r}]"
        if value.dtype.kind not in "fiu":
            raise InvalidInputError(f"{field}: must be numbers (float32), got {value.dtype}")
        if value.shape != targets.shape:
            raise InvalidInputError(
                f"{field}: has shape {list(value.shape)} but target_tokens has {list(targets.shape)}"
            )
        value = value.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(value))
        if bad.size:
            raise InvalidInputError(f"{field}: holds {value.reshape(-1)[bad[0]]} at flat position {int(bad[0])}")
        if key == "sequence_ratio_mask" and value.min(initial=0.0) < 0:
            raise InvalidInputError(f"{field}: must be >= 0 (1 on the tokens of the sequence ratio)")
        inputs[key] = value
    return inputs


def _policy(name: str, params: _Params) -> PolicyLoss | None:
    """The ``twinkle.loss`` object whose ``token_losses`` is this loss's per-token term (none for CE and GSPO)."""
    if name == "importance_sampling":
        return ImportanceSamplingLoss()
    if name in ("ppo", "cispo"):
        low, high = params.clip
        cls = PPOLoss if name == "ppo" else CISPOLoss
        return cls(epsilon=1 - low, epsilon_high=high - 1, reduction="token_sum")
    if name == "dro":
        return DROLoss(beta=params.beta)
    return None


def _flat_logps(lp: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """The per-datum log-probs as one ``[1, M]`` row, at least float32 (bfloat16 sums would lose precision)."""
    if len(lp) != len(shapes):
        raise ValueError(f"the loss got log-probs for {len(lp)} datums, the request has {len(shapes)}")
    for index, (tensor, shape) in enumerate(zip(lp, shapes, strict=True)):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"log-probs of datum {index} have shape {list(tensor.shape)}, its targets {list(shape)}")
    dtype = torch.promote_types(lp[0].dtype, torch.float32)
    return torch.cat([tensor.reshape(-1).to(dtype) for tensor in lp]).unsqueeze(0)


def _gspo_ratio(
    lp_BT: torch.Tensor, q_BT: torch.Tensor, mask_BT: torch.Tensor, segments: torch.Tensor, count: int
) -> torch.Tensor:
    """``r_t = sg(s)·exp(lp_t − sg(lp_t))``, ``s = exp(Σ m·(lp − q) / Σ m)`` per datum (``s = 1`` if ``Σ m = 0``)."""
    segments = segments.to(lp_BT.device)
    masked = (mask_BT * (lp_BT.detach() - q_BT))[0]
    sums = torch.zeros(count, dtype=lp_BT.dtype, device=lp_BT.device).index_add_(0, segments, masked)
    totals = torch.zeros(count, dtype=lp_BT.dtype, device=lp_BT.device).index_add_(0, segments, mask_BT[0])
    mean_log_ratio = torch.where(totals > 0, sums / totals.clamp(min=torch.finfo(totals.dtype).tiny), 0.0)
    return torch.exp(mean_log_ratio[segments].unsqueeze(0) + lp_BT - lp_BT.detach())
