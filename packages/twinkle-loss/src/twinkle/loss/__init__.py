"""Training objectives, each registered by class name and a snake_case alias (also as ``twinkle.loss`` entry points)."""

from twinkle.loss.alignment import per_sequence, per_token
from twinkle.loss.cross_entropy import CrossEntropyLoss
from twinkle.loss.gspo import GSPOLoss
from twinkle.loss.importance_sampling import CISPOLoss, DROLoss, ImportanceSamplingLoss
from twinkle.loss.policy import PolicyBatch, PolicyLoss, k3
from twinkle.loss.ppo import DRGRPOLoss, GRPOLoss, PPOLoss, clipped_surrogate
from twinkle.loss.preference import DPOLoss, PreferenceLoss, SimPOLoss
from twinkle.loss.reduction import (
    REDUCTIONS,
    ConstantLengthReduction,
    Reducer,
    TokenReduction,
    per_sequence_sums,
    token_weights,
)

__all__ = [
    "REDUCTIONS",
    "CISPOLoss",
    "ConstantLengthReduction",
    "CrossEntropyLoss",
    "DPOLoss",
    "DRGRPOLoss",
    "DROLoss",
    "GRPOLoss",
    "GSPOLoss",
    "ImportanceSamplingLoss",
    "PPOLoss",
    "PolicyBatch",
    "PolicyLoss",
    "PreferenceLoss",
    "Reducer",
    "SimPOLoss",
    "TokenReduction",
    "clipped_surrogate",
    "k3",
    "per_sequence",
    "per_sequence_sums",
    "per_token",
    "token_weights",
]
