"""Padded layout: features side by side in ``[B, T]`` tensors, ``T`` the longest feature."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.processor.features import TokenRow, sequence_lengths

# Padding is invisible to the model (attention_mask 0) and to the loss (label ignored, loss_mask 0).
_PAD_VALUES = {"attention_mask": 0, "position_ids": 0, "labels": IGNORE_INDEX, "loss_mask": 0}


def pad_rows(
    rows: Sequence[TokenRow],
    pad_token_id: int,
    padding_side: Literal["right", "left"],
) -> dict[str, torch.Tensor]:
    """Collate rows into ``[B, T]`` int64 tensors plus ``seq_lens`` and ``seq_starts``.

    ``seq_starts[i]`` is where feature ``i``'s first token lies in the flattened
    ``[B * T]`` token axis, which is all :func:`twinkle.processor.unpack` needs.
    """
    seq_lens = sequence_lengths(rows)
    max_len = max(seq_lens)
    pad_values = {"input_ids": pad_token_id, **_PAD_VALUES}
    batch = {
        name: torch.tensor([_pad(row[name], max_len, value, padding_side) for row in rows])
        for name, value in pad_values.items()
    }
    batch["seq_lens"] = torch.tensor(seq_lens)
    batch["seq_starts"] = torch.tensor(
        [i * max_len + (0 if padding_side == "right" else max_len - n) for i, n in enumerate(seq_lens)]
    )
    return batch


def _pad(values: list[int], length: int, value: int, side: Literal["right", "left"]) -> list[int]:
    padding = [value] * (length - len(values))
    return values + padding if side == "right" else padding + values
