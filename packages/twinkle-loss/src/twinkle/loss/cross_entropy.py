"""Supervised cross-entropy over the label tokens' log-probabilities."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Loss
from twinkle.loss.alignment import model_logps
from twinkle.loss.reduction import Reduction, TokenReduction
from twinkle.registry import register


@register("loss", name="cross_entropy")
@register("loss")
class CrossEntropyLoss(Loss):
    """``loss = reduce(-logp(label_t) · w_t)`` with ``w`` the loss mask (or float ``loss_weights``).

    Works on ``outputs.logps`` (``[B, T]``, the model computes them in chunks), so
    it never needs ``[B, T, V]`` logits: with ``reduction='token_mean'`` it equals
    ``torch.nn.functional.cross_entropy`` on shifted logits with ``ignore_index=-100``.
    Reductions are those of :class:`TokenReduction`.
    """

    def __init__(self, reduction: Reduction = "token_mean") -> None:
        self.reduction = TokenReduction(reduction)

    def normalizer(self, inputs: Mapping[str, Any]) -> float:
        """The whole batch's denominator (see :class:`TokenReduction`); raises if nothing is supervised."""
        return self.reduction.normalizer(inputs)

    def __call__(
        self, inputs: Mapping[str, Any], outputs: ModelOutput, normalizer: float | None = None, **loss_inputs: Any
    ) -> LossOutput:
        if loss_inputs:
            raise InvalidInputError(f"CrossEntropyLoss takes no extra inputs, got {sorted(loss_inputs)}")
        logps_BT, _ = model_logps(inputs, outputs, "CrossEntropyLoss")
        loss, num_tokens = self.reduction.reduce(-logps_BT, inputs, normalizer)
        return LossOutput(loss=loss, num_tokens=num_tokens)
