"""Training objectives. Each is registered by class name (and in the ``twinkle.loss`` entry points)."""

from twinkle.loss.cross_entropy import CrossEntropyLoss
from twinkle.loss.reduction import REDUCTIONS, TokenReduction, per_sequence_sums, token_weights

__all__ = ["REDUCTIONS", "CrossEntropyLoss", "TokenReduction", "per_sequence_sums", "token_weights"]
