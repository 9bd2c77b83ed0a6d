"""Activation checkpointing of megatron-core's decoder layers on any device.

megatron-core's own recompute (``recompute_granularity='full'``) saves and restores the CUDA RNG tracker's
states, so it needs CUDA; here each chosen decoder layer's forward runs under PyTorch's non-reentrant
checkpoint instead: only the layer's inputs are kept, and backward recomputes the rest. The model's
dropouts are zero, so a recomputed layer computes what its forward did on any device. A recomputed layer
must also see what its forward saw outside its inputs: the rows' position ids (the decoder clears them
when its forward returns, so they are captured here) and the rows' adapters (the pass engine
back-propagates inside their routing, as on :class:`TransformersModel`). Collectives inside a layer
(tensor parallelism, expert parallelism's all-to-all) run again in backward, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.utils.checkpoint import checkpoint

from twinkle.model.megatron.attention import RowPositions


def checkpoint_layers(layers: Iterable[TransformerLayer], positions: RowPositions, every_n_layers: int) -> None:
    """Recompute in backward every ``every_n_layers``-th of ``layers`` by the model's numbering (from the first,
    as transformers counts), whichever pipeline stage holds it."""
    for layer in layers:
        if (layer.layer_number - 1) % every_n_layers == 0:  # megatron numbers the model's layers from 1
            # An instance attribute: the module keeps its class, name and parameters (checkpoints are unchanged).
            layer.forward = RecomputedForward(layer.forward, positions)


class RecomputedForward:
    """A layer's ``forward`` that keeps only its inputs when a backward can come (training, grad enabled)."""

    def __init__(self, forward: Callable[..., Any], positions: RowPositions) -> None:
        self.forward = forward
        self.positions = positions

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self._at_positions, self.positions.position_ids_BS, *args, use_reentrant=False, **kwargs)

    def _at_positions(self, position_ids_BS: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        outer = self.positions.position_ids_BS
        self.positions.position_ids_BS = position_ids_BS
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.positions.position_ids_BS = outer
