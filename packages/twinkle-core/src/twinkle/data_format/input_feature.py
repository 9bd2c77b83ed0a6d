"""``InputFeature``: one encoded sequence, ready to be collated into model tensors.

It is a plain dict (rows of an encoded ``datasets`` table, JSON on the wire).
Token-level fields are lists of ints of equal length; ``labels`` holds the next
token targets *unshifted* (``labels[i]`` is the token at position ``i`` when it
is trained, else ``IGNORE_INDEX``) and ``loss_mask`` is the same information as
0/1, kept so losses and metrics need not know the ignore convention. The
trajectory that produced the feature may ride along (``messages``,
``user_data``) for rewards computed later. ``routed_experts`` (MoE models, from
a sampler that records routing) holds, per token, every MoE layer's chosen
experts (``[T][layers][top_k]``, ``-1``: route freely), for router replay.

Vision-language features add ``pixel_values`` (every image's patches, ``[patches][patch_dim]``, as the
model's image processor flattens them), ``image_grid_thw`` (``[images][3]``: each image's temporal, height
and width patch counts) and ``mm_token_type_ids`` (per token: 1 for an image token, else 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from annotated_types import Ge, MinLen
from typing_extensions import NotRequired, TypedDict  # pydantic needs this TypedDict below Python 3.12

from twinkle.data_format.message import Message
from twinkle.errors import InvalidInputError

IGNORE_INDEX = -100
FREE_EXPERT = -1  # in ``routed_experts``: nothing recorded for this token, its router chooses

TOKEN_FIELDS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids", "labels", "loss_mask")


class InputFeature(TypedDict):
    """One encoded sequence. Only ``input_ids`` is required; see module docstring.

    The ``Annotated`` bounds are what :func:`validate_input_feature` enforces, spelled out for schemas.
    """

    input_ids: Annotated[list[Annotated[int, Ge(0)]], MinLen(1)]
    attention_mask: NotRequired[list[int]]
    position_ids: NotRequired[list[int]]
    labels: NotRequired[list[int]]
    loss_mask: NotRequired[list[int]]
    length: NotRequired[int]
    messages: NotRequired[list[Message]]
    user_data: NotRequired[dict[str, Any]]
    routed_experts: NotRequired[list[list[list[int]]]]
    pixel_values: NotRequired[list[list[float]]]
    image_grid_thw: NotRequired[list[list[int]]]
    mm_token_type_ids: NotRequired[list[int]]


def _int_list(value: Any, name: str, where: str) -> list[int]:
    if hasattr(value, "tolist"):  # numpy arrays and torch tensors
        value = value.tolist()
    if type(value) is list and _INT.issuperset(map(type, value)):  # the usual case, checked at C speed
        return list(value)
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise InvalidInputError(f"{where}.{name} must be a list of ints, got {type(value).__name__}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise InvalidInputError(f"{where}.{name}[{i}] must be an int, got {item!r}")
    return list(value)


_INT = frozenset({int})


def make_input_feature(
    input_ids: Sequence[int],
    labels: Sequence[int] | None = None,
    **extra: Any,
) -> InputFeature:
    """Build a complete feature from ids (and optional labels): masks, positions, length."""
    ids = list(input_ids)
    feature: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": [1] * len(ids),
        "position_ids": list(range(len(ids))),
        "length": len(ids),
        **extra,
    }
    if labels is not None:
        feature["labels"] = list(labels)
        feature["loss_mask"] = [int(t != IGNORE_INDEX) for t in feature["labels"]]
    return validate_input_feature(feature)


def validate_input_feature(
    feature: Any,
    where: str = "input_feature",
    vocab_size: int | None = None,
) -> InputFeature:
    """Check a feature's types, lengths and ranges; return it with lists normalised.

    ``vocab_size``, when known, rejects token ids the model cannot embed — the most
    common silent corruption in hand-made data.
    """
    if not isinstance(feature, Mapping):
        raise InvalidInputError(f"{where} must be a dict with 'input_ids', got {type(feature).__name__}")
    if "input_ids" not in feature:
        raise InvalidInputError(f"{where} has no 'input_ids'")
    out: dict[str, Any] = dict(feature)
    for name in TOKEN_FIELDS:
        if out.get(name) is not None:
            out[name] = _int_list(out[name], name, where)
    ids = out["input_ids"]
    if not ids:
        raise InvalidInputError(f"{where}.input_ids is empty")
    for name in TOKEN_FIELDS[1:]:
        if out.get(name) is not None and len(out[name]) != len(ids):
            raise InvalidInputError(f"{where}.{name} has length {len(out[name])} but input_ids has length {len(ids)}")
    if vocab_size is not None:
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise InvalidInputError(
                f"{where}.input_ids contains ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )
    elif min(ids) < 0:
        raise InvalidInputError(f"{where}.input_ids contains negative ids")
    labels, loss_mask = out.get("labels"), out.get("loss_mask")
    if labels is not None and loss_mask is not None and loss_mask != [int(label != IGNORE_INDEX) for label in labels]:
        for i, (label, mask) in enumerate(zip(labels, loss_mask, strict=True)):
            if mask not in (0, 1) or (mask == 1) != (label != IGNORE_INDEX):
                raise InvalidInputError(
                    f"{where}.loss_mask[{i}]={mask} disagrees with labels[{i}]={label} "
                    f"(loss_mask must be 1 exactly where labels != {IGNORE_INDEX})"
                )
    length = out.get("length")
    if length is not None and length != len(ids):
        raise InvalidInputError(f"{where}.length is {length} but input_ids has length {len(ids)}")
    if out.get("routed_experts") is not None:
        out["routed_experts"] = _routing(out["routed_experts"], len(ids), f"{where}.routed_experts")
    if out.get("mm_token_type_ids") is not None:
        out["mm_token_type_ids"] = _int_list(out["mm_token_type_ids"], "mm_token_type_ids", where)
        if len(out["mm_token_type_ids"]) != len(ids):
            raise InvalidInputError(
                f"{where}.mm_token_type_ids has length {len(out['mm_token_type_ids'])} but input_ids has {len(ids)}"
            )
    if (out.get("pixel_values") is None) != (out.get("image_grid_thw") is None):
        raise InvalidInputError(f"{where} needs both pixel_values and image_grid_thw, or neither")
    return out  # type: ignore[return-value]


def _routing(value: Any, tokens: int, where: str) -> list[list[list[int]]]:
    """``[tokens][layers][top_k]`` expert ids >= -1, every token with the same numbers of layers and experts."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, Sequence) or len(value) != tokens:
        size = len(value) if isinstance(value, Sequence) else type(value).__name__
        raise InvalidInputError(f"{where} must hold one entry per token ({tokens}), got {size}")
    shape: tuple[int, int] | None = None
    for t, layers in enumerate(value):
        if not isinstance(layers, Sequence) or not all(isinstance(chosen, Sequence) for chosen in layers):
            raise InvalidInputError(f"{where}[{t}] must be a list (one per MoE layer) of lists of expert ids")
        found = (len(layers), len(layers[0]) if layers else 0)
        if shape is not None and found != shape:
            raise InvalidInputError(f"{where}[{t}] is {found[0]} layers x {found[1]} experts, [0] is {shape}")
        shape = found
        for chosen in layers:
            if any(isinstance(e, bool) or not isinstance(e, int) or e < -1 for e in chosen):
                raise InvalidInputError(f"{where}[{t}] has an expert id that is not an int >= -1: {list(chosen)}")
    return [[list(chosen) for chosen in layers] for layers in value]


def unshifted_labels(feature: InputFeature, where: str = "input_feature") -> list[int]:
    """A validated feature's unshifted labels: ``labels`` (checked against the ids), else from ``loss_mask``,
    else all ignored (nothing trained)."""
    input_ids = feature["input_ids"]
    labels = feature.get("labels")
    if labels is None:
        loss_mask = feature.get("loss_mask")
        if loss_mask is None:
            return [IGNORE_INDEX] * len(input_ids)
        check_binary(loss_mask, f"{where}.loss_mask")
        return [token if mask else IGNORE_INDEX for token, mask in zip(input_ids, loss_mask, strict=True)]
    for i, (label, token) in enumerate(zip(labels, input_ids, strict=True)):
        if label not in (IGNORE_INDEX, token):
            raise InvalidInputError(
                f"{where}.labels[{i}]={label} but input_ids[{i}]={token}: labels must be unshifted "
                f"(each position's own token, or {IGNORE_INDEX} when not trained)"
            )
    return list(labels)


def check_binary(values: Sequence[int], where: str) -> None:
    """Raise unless every value is 0 or 1 (masks)."""
    for i, value in enumerate(values):
        if value not in (0, 1):
            raise InvalidInputError(f"{where}[{i}]={value}: only 0 and 1 are allowed")
