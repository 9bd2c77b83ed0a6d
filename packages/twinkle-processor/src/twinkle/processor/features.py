"""Complete validated features into token rows that every layout collates the same way.

A row has all five token fields. Missing ones are derived: ``attention_mask``
all ones, ``position_ids`` ``0..n-1``, ``labels`` from ``loss_mask`` (labels are
unshifted, so a trained position's label is its own token) or all ignored.

The first label of every row is forced to ``IGNORE_INDEX``. Losses shift by
one (``logits[:, :-1]`` predict ``labels[:, 1:]``), so a sequence's first token
is never a target of its own sequence; in a packed row, or behind left padding,
the position before it belongs to another sequence or to padding, and a
trainable first label would teach the model to predict across that boundary.
Ignoring it therefore loses nothing and makes every layout safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twinkle.data_format import IGNORE_INDEX, InputFeature, check_binary, unshifted_labels, validate_input_feature
from twinkle.errors import InvalidInputError

TokenRow = dict[str, list[int]]


def complete_features(features: Sequence[InputFeature], max_length: int | None) -> list[TokenRow]:
    """Validate every feature (errors name ``features[i]``) and complete it into a :data:`TokenRow`."""
    if isinstance(features, Mapping) or not isinstance(features, Sequence):
        raise InvalidInputError(f"InputProcessor expects a list of InputFeature dicts, got {type(features).__name__}")
    if not features:
        raise InvalidInputError("InputProcessor got an empty batch: pass at least one feature")
    return [_complete(feature, f"features[{i}]", max_length) for i, feature in enumerate(features)]


def sequence_lengths(rows: Sequence[TokenRow]) -> list[int]:
    """The unpadded length of every row, in batch order."""
    return [len(row["input_ids"]) for row in rows]


def _complete(feature: InputFeature, where: str, max_length: int | None) -> TokenRow:
    checked = validate_input_feature(feature, where=where)
    input_ids = checked["input_ids"]
    if max_length is not None and len(input_ids) > max_length:
        raise InvalidInputError(f"{where} has {len(input_ids)} tokens, more than max_length={max_length}")
    attention_mask = checked.get("attention_mask") or [1] * len(input_ids)
    check_binary(attention_mask, f"{where}.attention_mask")
    labels = unshifted_labels(checked, where)
    labels = [IGNORE_INDEX, *labels[1:]]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": checked.get("position_ids") or list(range(len(input_ids))),
        "labels": labels,
        "loss_mask": [int(label != IGNORE_INDEX) for label in labels],
    }
