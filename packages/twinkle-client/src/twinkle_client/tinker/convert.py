"""Twinkle's ``InputFeature`` and Tinker's ``Datum``: the same next-token data, shifted differently.

A feature holds the whole sequence with *unshifted* labels (``labels[i]`` is
token ``i`` when it is trained, else ``-100``). A datum holds the inputs
``tokens[:-1]`` and, per input position ``t``, the target ``tokens[t + 1]`` with
weight 1.0 when that target is trained, else 0.0. So ``labels[0]`` has no datum
form (nothing predicts the first token; Twinkle always ignores it), and a
feature whose first label is ignored survives a round trip exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle.data_format import (
    IGNORE_INDEX,
    InputFeature,
    make_input_feature,
    unshifted_labels,
    validate_input_feature,
)
from twinkle.errors import InvalidInputError
from twinkle_client.tinker.sdk import require_tinker

if TYPE_CHECKING:
    from tinker import types as tinker_types


def input_feature_to_datum(feature: Mapping[str, Any], images: Sequence[bytes] | None = None) -> tinker_types.Datum:
    """A Tinker ``Datum`` (``target_tokens`` int64, ``weights`` float32) that trains what ``feature`` trains.

    Labels come from ``labels``, else from ``loss_mask``, else nothing is trained
    (the rule of Twinkle's own collation). Raises ``InvalidInputError`` for
    fewer than two tokens, labels other than the token itself or ``-100``, and
    padded or packed features (a datum is one unpadded sequence).

    A vision-language feature (``mm_token_type_ids``) needs its ``images`` as encoded PNG or JPEG bytes, in
    order: each run of image tokens becomes an image chunk of that image, with ``expected_tokens`` the run's
    length, which the server checks against its image processor.
    """
    types = require_tinker().types
    checked = validate_input_feature(feature, where="feature")
    ids = checked["input_ids"]
    if len(ids) < 2:
        raise InvalidInputError(
            f"feature.input_ids has {len(ids)} token: a Datum needs at least 2 (position t is trained on token t+1)"
        )
    _check_single_sequence(checked)
    labels = unshifted_labels(checked, "feature")
    weights = [0.0 if label == IGNORE_INDEX else 1.0 for label in labels[1:]]
    return types.Datum(
        model_input=_model_input(ids[:-1], checked.get("mm_token_type_ids"), images),
        loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:], dtype=np.int64),
            "weights": np.asarray(weights, dtype=np.float32),
        },
    )


def datum_to_input_feature(datum: tinker_types.Datum) -> InputFeature:
    """The ``InputFeature`` (ids, labels, masks, positions, length) of a next-token ``datum``.

    ``target_tokens`` must be 1-D and continue ``model_input`` (``targets[t] ==
    tokens[t + 1]``); ``weights`` (all ones when absent) must be 0 or 1, as a
    feature cannot express other weights. Other loss inputs (``logprobs``,
    ``advantages``, ...) have no place in a feature and are left out.
    """
    types = require_tinker().types
    if not isinstance(datum, types.Datum):
        raise InvalidInputError(f"expected a tinker.types.Datum, got {type(datum).__name__}")
    try:
        inputs = datum.model_input.to_ints()
    except ValueError as exc:  # image chunks: a feature holds token ids only
        raise InvalidInputError(f"datum.model_input must hold only tokens: {exc}") from exc
    if not inputs:
        raise InvalidInputError("datum.model_input is empty")
    targets = _vector(datum, "target_tokens", len(inputs))
    if targets is None:
        raise InvalidInputError("datum.loss_fn_inputs has no 'target_tokens'")
    if targets.dtype.kind not in "iu":
        raise InvalidInputError(f"datum.loss_fn_inputs['target_tokens'] must be integer token ids, got {targets.dtype}")
    target_ids = [int(t) for t in targets]
    for t in range(len(inputs) - 1):
        if target_ids[t] != inputs[t + 1]:
            raise InvalidInputError(
                f"datum.loss_fn_inputs['target_tokens'][{t}]={target_ids[t]} but model_input[{t + 1}]={inputs[t + 1]}: "
                "only next-token data (targets = the inputs shifted by one) has an InputFeature form"
            )
    weights = _vector(datum, "weights", len(inputs))
    trained = [True] * len(inputs) if weights is None else [_trained(w, t) for t, w in enumerate(weights.tolist())]
    labels = [IGNORE_INDEX] + [token if keep else IGNORE_INDEX for token, keep in zip(target_ids, trained, strict=True)]
    return make_input_feature([*inputs, target_ids[-1]], labels)


def _model_input(ids: list[int], types_: list[int] | None, images: Sequence[bytes] | None) -> Any:
    """Text chunks, with an image chunk for each run of image tokens (``types_[t] == 1``)."""
    types = require_tinker().types
    runs = [t for t in range(len(ids)) if types_ and types_[t] == 1 and (t == 0 or types_[t - 1] == 0)]
    images = list(images or [])
    if len(runs) != len(images):
        raise InvalidInputError(
            f"feature holds {len(runs)} image(s) (runs of mm_token_type_ids 1) but {len(images)} were given: "
            "pass each image's encoded bytes, in order"
        )
    chunks: list[Any] = []
    start = 0
    for run, image in zip(runs, images, strict=True):
        end = run
        while end < len(ids) and types_ is not None and types_[end] == 1:
            end += 1
        fmt = "png" if image.startswith(b"\x89PNG") else "jpeg" if image.startswith(b"\xff\xd8") else None
        if fmt is None:
            raise InvalidInputError("images must be encoded PNG or JPEG bytes (what a Tinker image chunk holds)")
        chunks += [
            types.EncodedTextChunk(tokens=ids[start:run]),
            types.ImageChunk(data=image, format=fmt, expected_tokens=end - run),
        ]
        start = end
    chunks.append(types.EncodedTextChunk(tokens=ids[start:]))
    return types.ModelInput(chunks=[chunk for chunk in chunks if chunk.length])


def _check_single_sequence(feature: InputFeature) -> None:
    """A datum is one unpadded sequence at positions 0..n-1; refuse what would silently change meaning."""
    attention_mask = feature.get("attention_mask")
    if attention_mask is not None and any(value != 1 for value in attention_mask):
        raise InvalidInputError("feature.attention_mask has padding (values other than 1): a Datum cannot hold padding")
    position_ids = feature.get("position_ids")
    if position_ids is not None and position_ids != list(range(len(feature["input_ids"]))):
        raise InvalidInputError(
            "feature.position_ids are not 0..n-1 (a packed feature?): convert each sequence on its own"
        )


def _vector(datum: tinker_types.Datum, name: str, length: int) -> np.ndarray | None:
    """``loss_fn_inputs[name]`` as a 1-D array of ``length`` values, or ``None`` when absent."""
    tensor = datum.loss_fn_inputs.get(name)
    if tensor is None:
        return None
    where = f"datum.loss_fn_inputs[{name!r}]"
    values = tensor.to_numpy()
    if values.ndim != 1:
        raise InvalidInputError(
            f"{where} has shape {list(values.shape)}: only 1-D (one target per position) data has an InputFeature form"
        )
    if len(values) != length:
        raise InvalidInputError(f"{where} has {len(values)} values but model_input has {length} tokens")
    return values


def _trained(weight: float, position: int) -> bool:
    if weight not in (0.0, 1.0):
        raise InvalidInputError(
            f"datum.loss_fn_inputs['weights'][{position}]={weight}: an InputFeature can only train (1) or skip (0)"
        )
    return weight == 1.0
