"""Results of model calls: :class:`ModelOutput` and :class:`LossOutput`.

Tensor fields are typed ``Any`` because ``twinkle-core`` does not import torch:
in-process they hold ``torch.Tensor``; across the wire, numpy arrays. Shapes
follow the suffix convention: ``B`` batch, ``T`` tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twinkle.data_format.serde import Serializable


@dataclass
class LossOutput(Serializable):
    """A scalar ``loss`` to back-propagate and the ``num_tokens`` it was reduced over.

    ``num_tokens`` lets gradient accumulation weight micro-batches correctly;
    ``metrics`` carries loss-specific scalars (clip fractions, KL, ...). Models
    average them over micro-batches, data-parallel ranks and calls, except
    maxima, named ``*_max``, which combine by their largest value.
    """

    loss: Any
    num_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ModelOutput(Serializable):
    """What ``forward`` returns.

    ``logps`` are per-token log-probabilities of the label tokens, ``[B, T]``
    aligned with ``input_ids`` (0 where a position has no label); ``logits`` is
    only filled when explicitly requested, since ``[B, T, V]`` is large.
    """

    loss: Any = None
    logps: Any = None
    logits: Any = None
    values: Any = None
    num_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
