"""The batch's ``routed_experts``: features' recorded MoE routing laid out like their tokens, for router replay."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from twinkle.data_format import FREE_EXPERT, InputFeature
from twinkle.errors import InvalidInputError


def routing_tensor(features: Sequence[InputFeature], batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The features' ``routed_experts`` as ``[B, T, layers, top_k]`` int64 in ``batch``'s layout (``None``: none).

    Features are validated already; every one that has a record must have the same layers and top-k.
    """
    records = {i: feature["routed_experts"] for i, feature in enumerate(features) if feature.get("routed_experts")}
    if not records:
        return None
    shapes = {(len(record[0]), len(record[0][0])) for record in records.values()}
    if len(shapes) > 1:
        raise InvalidInputError(f"features' routed_experts differ in (layers, top_k): {sorted(shapes)}")
    layers, top_k = shapes.pop()
    rows, width = batch["input_ids"].shape
    routed_NLK = torch.full(
        (rows * width, layers, top_k), FREE_EXPERT, dtype=torch.long
    )  # padding, features without a record
    starts = batch["seq_starts"].tolist()
    for index, record in records.items():
        routed_NLK[starts[index] : starts[index] + len(record)] = torch.tensor(record, dtype=torch.long)
    return routed_NLK.view(rows, width, layers, top_k)
