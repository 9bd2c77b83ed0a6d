"""Padding-free layout: every feature concatenated into one ``[1, ΣT]`` row.

The model tells the sequences apart by ``position_ids`` restarting at 0 (how
transformers builds a block-diagonal causal mask for sdpa/eager and varlen
flash attention) or by ``cu_seq_lens`` (for kernels that take them directly).
Hence each feature must be unmasked and positioned ``0..n-1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from twinkle.errors import InvalidInputError
from twinkle.processor.features import TokenRow, sequence_lengths

_PACKED_FIELDS = ("input_ids", "position_ids", "labels", "loss_mask")


def pack_rows(rows: Sequence[TokenRow]) -> dict[str, torch.Tensor]:
    """Concatenate rows into ``[1, ΣT]`` int64 tensors plus ``seq_lens``, ``cu_seq_lens`` and ``seq_starts``.

    ``cu_seq_lens`` is ``[0, n0, n0+n1, ...]`` as int32, the format flash
    attention's varlen kernels expect. There is deliberately no
    ``attention_mask``: transformers only looks for packed sequences when the
    mask is ``None``; an all-ones mask would merge them into one causal sequence.
    """
    for i, row in enumerate(rows):
        _check_packable(row, f"features[{i}]")
    batch = {name: torch.tensor([list(chain.from_iterable(row[name] for row in rows))]) for name in _PACKED_FIELDS}
    seq_lens_N = torch.tensor(sequence_lengths(rows))
    cu_seq_lens = torch.nn.functional.pad(torch.cumsum(seq_lens_N, dim=0), (1, 0)).to(torch.int32)
    batch["seq_lens"] = seq_lens_N
    batch["cu_seq_lens"] = cu_seq_lens
    batch["seq_starts"] = cu_seq_lens[:-1].long()
    return batch


def _check_packable(row: TokenRow, where: str) -> None:
    if 0 in row["attention_mask"]:
        raise InvalidInputError(
            f"{where}.attention_mask masks position {row['attention_mask'].index(0)}; a padding-free batch has no "
            "attention mask, so remove masked tokens from the feature or use padding_free=False"
        )
    if row["position_ids"] != list(range(len(row["position_ids"]))):
        raise InvalidInputError(
            f"{where}.position_ids must be 0..{len(row['position_ids']) - 1} in padding-free mode "
            "(sequence boundaries are where positions restart at 0)"
        )
