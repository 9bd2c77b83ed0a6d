"""Pairwise preference losses: DPO (sigmoid, IPO, hinge) and SimPO.

Batch layout: ``2N`` sequences, the ``N`` chosen responses first and then
their ``N`` rejected alternatives in the same order, so sequences ``i`` and
``i + N`` form pair ``i`` (rows of a padded batch, or a packed row's sequences
in ``seq_lens`` order): one forward over both halves.

A micro-batch is a contiguous slice of the samples, so it would pair the wrong
sequences: the losses are ``pairwise`` (:class:`twinkle.interfaces.Loss`), and
a model refuses ``micro_batch_size`` for them (accumulate gradients over
several calls for large batches). :meth:`PreferenceLoss.normalizer` is the
batch's number of pairs and the loss is the sum over pairs divided by it: the
mean over pairs, and under data parallelism, where every rank lays out its
own whole pairs and the normaliser is the global batch's, each rank's share of
the global mean.

A sequence's log-probability ``lp(y)`` is the (weighted) sum of its trained
tokens' ``logps``; ``|y|`` is their (weighted) count. Every preference loss
reports, over this call's pairs with implicit rewards ``r_c`` and ``r_r``:
``chosen_reward``, ``rejected_reward``, ``accuracy`` (fraction with ``r_c > r_r``)
and ``margin`` (mean ``r_c − r_r``), as :class:`twinkle.metric.DPOMetric` names them.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.interfaces import Loss
from twinkle.loss.alignment import model_logps, per_sequence
from twinkle.loss.reduction import per_sequence_sums, token_weights
from twinkle.registry import register

DPOLossType = Literal["sigmoid", "ipo", "hinge"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")


class PreferenceLoss(Loss):
    """Base of the pairwise losses: ``mean over pairs of pair_losses(...)`` on the layout of the module docstring."""

    input_names: tuple[str, ...] = ()
    pairwise = True

    def normalizer(self, inputs: Mapping[str, Any]) -> float:
        """The batch's number of pairs."""
        return float(_num_pairs(per_sequence_sums(token_weights(inputs), inputs).numel(), type(self).__name__))

    @abstractmethod
    def pair_losses(
        self, logps_S: torch.Tensor, lengths_S: torch.Tensor, inputs: Mapping[str, Any], loss_inputs: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-pair losses ``[N]`` and the implicit rewards of the chosen and the rejected sides, ``[N]`` each.

        ``loss_inputs`` holds this call's extra inputs, only names from ``input_names``.
        """

    def __call__(
        self, inputs: Mapping[str, Any], outputs: ModelOutput, normalizer: float | None = None, **loss_inputs: Any
    ) -> LossOutput:
        name = type(self).__name__
        unknown = sorted(set(loss_inputs) - set(self.input_names))
        if unknown:
            raise InvalidInputError(f"{name} got unknown inputs {unknown}; it takes {list(self.input_names)}")
        logps_BT, weights_BT = model_logps(inputs, outputs, name)
        lengths_S = per_sequence_sums(weights_BT, inputs)
        pairs = _num_pairs(lengths_S.numel(), name)
        if normalizer is not None and normalizer < pairs:
            raise InvalidInputError(
                f"{name} got normalizer={normalizer:g} for a call with {pairs} pairs: it must be the number of "
                "pairs of the whole (global) batch"
            )
        empty = (lengths_S <= 0).nonzero()
        if empty.numel():
            raise InvalidInputError(f"{name}: sequence {int(empty[0])} has no trained token; every response needs one")
        logps_S = per_sequence_sums(logps_BT * weights_BT, inputs)
        losses_P, chosen_P, rejected_P = self.pair_losses(logps_S, lengths_S, inputs, loss_inputs)
        chosen_P, rejected_P = chosen_P.detach(), rejected_P.detach()
        metrics = {
            "chosen_reward": float(chosen_P.mean()),
            "rejected_reward": float(rejected_P.mean()),
            "accuracy": float((chosen_P > rejected_P).double().mean()),
            "margin": float((chosen_P - rejected_P).mean()),
        }
        denominator = pairs if normalizer is None else normalizer  # the global batch's pairs, under data parallelism
        return LossOutput(loss=losses_P.sum() / denominator, num_tokens=int((weights_BT > 0).sum()), metrics=metrics)


@register("loss", name="dpo")
@register("loss")
class DPOLoss(PreferenceLoss):
    """DPO (Rafailov et al. 2023) and two variants on ``h = (lp(y_c) − ref(y_c)) − (lp(y_r) − ref(y_r))``.

    - ``'sigmoid'``: ``−(1−ε)·log σ(β·h) − ε·log σ(−β·h)``; ``ε = label_smoothing``
      is conservative DPO (cDPO, Mitchell 2023) and 0 is plain DPO;
    - ``'ipo'`` (Azar et al. 2023, eq. 17 with ``τ = beta``): ``(h − 1/(2β))²`` with every
      ``lp``/``ref`` divided by ``|y|`` (per-token means, as in the IPO paper and TRL);
    - ``'hinge'`` (SLiC, Zhao et al. 2023): ``max(0, 1 − β·h)``.

    The implicit rewards are ``β·(lp(y) − ref(y))`` (after IPO's length
    division). ``ref_logps`` are the reference model's: per sequence either its
    summed log-probability (``2N`` numbers, in the batch's order) or per-token
    lists (summed here over the trained tokens). ``reference_free=True`` uses
    ``ref = 0`` and takes no ``ref_logps``.
    """

    input_names = ("ref_logps",)

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: DPOLossType = "sigmoid",
        label_smoothing: float = 0.0,
        reference_free: bool = False,
    ) -> None:
        if loss_type not in DPO_LOSS_TYPES:
            raise ConfigurationError(f"unknown DPO loss_type {loss_type!r}; use one of {DPO_LOSS_TYPES}")
        if not 0 <= label_smoothing < 0.5:
            raise ConfigurationError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        if label_smoothing and loss_type != "sigmoid":
            raise ConfigurationError(f"label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}")
        self.beta = _positive(beta, "beta")
        self.loss_type = loss_type
        self.label_smoothing = float(label_smoothing)
        self.reference_free = reference_free
        self.required_inputs = () if reference_free else ("ref_logps",)

    def pair_losses(
        self, logps_S: torch.Tensor, lengths_S: torch.Tensor, inputs: Mapping[str, Any], loss_inputs: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ref_logps = loss_inputs.get("ref_logps")
        if self.reference_free and ref_logps is not None:
            raise InvalidInputError("DPOLoss(reference_free=True) takes no ref_logps")
        if not self.reference_free and ref_logps is None:
            raise InvalidInputError(
                "DPOLoss needs ref_logps: the reference model's log-probability of each sequence (2N numbers, "
                "chosen first) or its per-token log-probs; or set reference_free=True"
            )
        ref_S = (
            torch.zeros_like(logps_S)
            if ref_logps is None
            else per_sequence(ref_logps, inputs, "ref_logps", dtype=logps_S.dtype, device=logps_S.device)
        )
        if self.loss_type == "ipo":
            logps_S, ref_S = logps_S / lengths_S, ref_S / lengths_S
        log_ratios_S = logps_S - ref_S
        chosen_P, rejected_P = log_ratios_S.chunk(2)
        h_P = chosen_P - rejected_P
        if self.loss_type == "sigmoid":
            smoothing = self.label_smoothing
            losses_P = -(1 - smoothing) * F.logsigmoid(self.beta * h_P) - smoothing * F.logsigmoid(-self.beta * h_P)
        elif self.loss_type == "hinge":
            losses_P = torch.relu(1 - self.beta * h_P)
        else:
            losses_P = (h_P - 1 / (2 * self.beta)) ** 2
        return losses_P, self.beta * chosen_P, self.beta * rejected_P


@register("loss", name="simpo")
@register("loss")
class SimPOLoss(PreferenceLoss):
    """SimPO (Meng et al. 2024): ``−log σ(β·lp(y_c)/|y_c| − β·lp(y_r)/|y_r| − γ)``, no reference model.

    The implicit reward is the length-normalised ``β·lp(y)/|y|``; ``gamma`` is the
    target reward margin. Defaults ``beta=2.0, gamma=0.5`` are in the paper's range.
    """

    def __init__(self, beta: float = 2.0, gamma: float = 0.5) -> None:
        self.beta = _positive(beta, "beta")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma):
            raise ConfigurationError(f"gamma must be a finite number, got {gamma!r}")
        self.gamma = float(gamma)

    def pair_losses(
        self, logps_S: torch.Tensor, lengths_S: torch.Tensor, inputs: Mapping[str, Any], loss_inputs: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen_P, rejected_P = (self.beta * logps_S / lengths_S).chunk(2)
        return -F.logsigmoid(chosen_P - rejected_P - self.gamma), chosen_P, rejected_P


def _num_pairs(sequences: int, loss_name: str) -> int:
    if sequences % 2:
        raise InvalidInputError(
            f"{loss_name} needs an even number of sequences (N chosen, then their N rejected), got {sequences}"
        )
    return sequences // 2


def _positive(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)
