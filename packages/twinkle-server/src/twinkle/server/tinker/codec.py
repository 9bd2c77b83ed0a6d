"""Tinker's wire formats to and from plain numpy: ``forward_backward`` requests in, training results out.

Requests arrive as the SDK's protobuf (``tinker.proto.tinker_public_pb2``,
optionally zstd-compressed) or, on the legacy ``/forward`` route, as JSON
(:func:`datum_from_json`). Both become :class:`Datum` objects with dense numpy
arrays, so the loss and trainer code never sees a wire detail. Replies are
encoded exactly as ``tinker.proto.response_conv`` decodes them.

Image chunks stay encoded here (:class:`~twinkle.server.tinker.images.WireImage`, each
at its offset among the text tokens); :mod:`twinkle.server.tinker.images` turns them
into the model's vision tokens and pixel values.

Anything malformed raises :class:`~twinkle.errors.InvalidInputError` whose
message starts with the offending field, e.g. ``data[2].loss_fn_inputs['weights']: ...``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from twinkle.errors import InvalidInputError
from twinkle.server.tinker.images import WireImage, image_from_json, image_from_proto

MAX_DECOMPRESSED_BYTES = 1 << 30
# A CSR tensor's dense shape is not bounded by the body size, so cap it (1 GiB of float32).
MAX_TENSOR_ELEMENTS = 1 << 28
METRIC_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")

_PROTO_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),  # raw bits, widened to float32 after reading
}
_JSON_DTYPES: dict[str, np.dtype[Any]] = {"float32": np.dtype(np.float32), "int64": np.dtype(np.int64)}
# The SDK's dtype for a plain list under these keys (tinker/types/datum.py).
_JSON_KEY_DTYPES = {"target_tokens": "int64"}
_CHUNKS = "this server takes encoded_text and image chunks"


@dataclass
class Datum:
    """One training example: ``tokens[t]`` is the model input at position ``t``, aligned with each input's row ``t``.

    With image chunks, ``tokens`` holds the text tokens only until
    :func:`twinkle.server.tinker.images.expand_images` puts each image's vision tokens at its offset
    and its pixel values in ``features``.
    """

    tokens: np.ndarray  # int64 [N]: the encoded_text chunks, concatenated
    loss_fn_inputs: dict[str, np.ndarray]  # dense (CSR cells not listed are 0), in the dtype sent
    images: list[WireImage] = field(default_factory=list)
    features: dict[str, Any] = field(default_factory=dict)  # pixel_values, image_grid_thw, mm_token_type_ids


@dataclass
class ForwardBackwardCall:
    """A decoded ``ForwardBackwardRequest``."""

    model_id: str
    seq_id: int  # 0 means "not set"
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool


def decode_forward_backward(
    body: bytes, content_encoding: str | None = None, *, max_bytes: int = MAX_DECOMPRESSED_BYTES
) -> ForwardBackwardCall:
    """The ``/api/v1/forward_backward`` (and ``/forward``) protobuf body, zstd-compressed when the header says so."""
    body = _decompress(body, content_encoding, max_bytes)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise InvalidInputError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    return ForwardBackwardCall(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        data=[_datum_from_proto(datum, index) for index, datum in enumerate(msg.data)],
        loss_fn=msg.loss_fn,
        loss_fn_config=_config_from_proto(msg),
        forward_only=msg.forward_only,
    )


def datum_from_json(datum: Mapping[str, Any], index: int = 0) -> Datum:
    """A datum's JSON form (``{model_input: {chunks}, loss_fn_inputs: {name: TensorData}}``); ``index`` names it."""
    where = f"data[{index}]"
    if not isinstance(datum, Mapping):
        raise InvalidInputError(f"{where}: a datum must be an object, got {type(datum).__name__}")
    tokens, images = model_input_from_json(datum.get("model_input"), f"{where}.model_input")
    inputs = datum.get("loss_fn_inputs", {})
    if not isinstance(inputs, Mapping):
        raise InvalidInputError(f"{where}.loss_fn_inputs: must be an object of tensors")
    return Datum(
        tokens=tokens,
        loss_fn_inputs={
            str(name): _tensor_from_json(value, str(name), f"{where}.loss_fn_inputs[{name!r}]")
            for name, value in inputs.items()
        },
        images=images,
    )


def model_input_from_json(model_input: Any, where: str) -> tuple[np.ndarray, list[WireImage]]:
    """A ``ModelInput``'s JSON form (``{chunks: [...]}``): its text tokens and its images, each at its offset."""
    chunks = model_input.get("chunks") if isinstance(model_input, Mapping) else None
    if not isinstance(chunks, list):
        raise InvalidInputError(f"{where}: must be an object with a 'chunks' list")
    parts: list[np.ndarray] = []
    images: list[WireImage] = []
    for number, chunk in enumerate(chunks):
        chunk_where = f"{where}.chunks[{number}]"
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, Mapping) else None
        if kind == "encoded_text":
            parts.append(_json_numbers(chunk.get("tokens"), np.dtype(np.int64), f"{chunk_where}.tokens"))
        elif kind == "image":
            images.append(image_from_json(chunk, sum(len(part) for part in parts), chunk_where))
        elif kind == "image_asset_pointer":
            raise InvalidInputError(
                f"{chunk_where}: image_asset_pointer chunks are not supported: this server has no image uploads, "
                "so send the image itself in an image chunk (tinker.types.ImageChunk)"
            )
        elif kind == "dmel":
            raise InvalidInputError(f"{chunk_where}: dmel (audio) chunks are not supported: {_CHUNKS}")
        else:
            raise InvalidInputError(f"{chunk_where}: not a model input chunk (type {kind!r}); {_CHUNKS}")
    return _tokens(parts, where, bool(images)), images


def encode_forward_backward_output(
    logps: Sequence[np.ndarray],
    metrics: Mapping[str, float],
    extra_fields: Mapping[str, Sequence[np.ndarray]] | None = None,
) -> bytes:
    """A ``ForwardBackwardOutput``: per datum ``logprobs`` (float32 ``[N]`` or ``[N, K]``) plus any extra fields.

    Datums are batched into one ``ArrayRecord``; a run of datums whose trailing
    shapes differ from the previous one's (e.g. another K) starts a new record,
    which the SDK concatenates. Metric keys must be ``name:reduction``.
    """
    fields: dict[str, list[np.ndarray]] = {"logprobs": [_output_array(a, "logprobs", i) for i, a in enumerate(logps)]}
    for name, arrays in (extra_fields or {}).items():
        if name in fields:
            raise ValueError(f"extra field {name!r} collides with the logprobs field")
        if len(arrays) != len(logps):
            raise ValueError(f"extra field {name!r} has {len(arrays)} datums, logprobs has {len(logps)}")
        fields[name] = [_output_array(a, name, i) for i, a in enumerate(arrays)]
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        name, _, reduction = key.partition(":")
        # The SDK's chunk merge does `name, reduction = key.split(":")`: anything else crashes the client.
        if not name or ":" in reduction or reduction not in METRIC_REDUCTIONS:
            raise ValueError(f"metric key {key!r} must be 'name:reduction' with a reduction in {METRIC_REDUCTIONS}")
        out.metrics[key] = float(value)
    start = 0
    while start < len(logps):
        shapes = _trailing_shapes(fields, start)
        end = start + 1
        while end < len(logps) and _trailing_shapes(fields, end) == shapes:
            end += 1
        record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=end - start)
        for (name, arrays), trailing in zip(fields.items(), shapes, strict=True):
            chunk = arrays[start:end]
            offsets = np.cumsum([0] + [a.nbytes for a in chunk], dtype=np.int64).astype("<i8")
            record.fields[name].CopyFrom(
                pb.BatchedTensor(
                    data=b"".join(a.tobytes() for a in chunk),
                    offsets=offsets.tobytes(),
                    dtype=pb.DTYPE_FLOAT32,
                    trailing_shape=trailing,
                )
            )
        start = end
    return out.SerializeToString()


def _decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise InvalidInputError(f"unsupported Content-Encoding {content_encoding!r}; send zstd or none")
    # Streamed, so a small body that inflates past max_bytes is refused before it is all in memory.
    parts: list[bytes] = []
    size = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        while part := reader.read(1 << 20):
            size += len(part)
            if size > max_bytes:
                raise InvalidInputError(f"the zstd body inflates to more than {max_bytes} bytes")
            parts.append(part)
    except zstandard.ZstdError as exc:
        raise InvalidInputError(f"the body is not valid zstd: {exc}") from exc
    return b"".join(parts)


def _config_from_proto(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    # The SDK writes floats to both maps and strings only to v2, so v2 (when set) is complete.
    if not msg.loss_fn_config_v2:
        return {key: float(value) for key, value in msg.loss_fn_config.items()}
    config: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise InvalidInputError(f"loss_fn_config_v2[{key!r}]: holds neither a number nor a text")
        config[key] = value.number if kind == "number" else value.text
    return config


def _datum_from_proto(msg: pb.Datum, index: int) -> Datum:
    where = f"data[{index}]"
    parts: list[np.ndarray] = []
    images: list[WireImage] = []
    for number, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        chunk_where = f"{where}.model_input[{number}]"
        if kind == "encoded_text":
            parts.append(_frombuffer(chunk.encoded_text.tokens, np.dtype("<i4"), f"{chunk_where}.tokens"))
        elif kind == "image":
            images.append(image_from_proto(chunk.image, sum(len(part) for part in parts), chunk_where))
        elif kind is None:
            raise InvalidInputError(f"{chunk_where}: empty chunk (no encoded_text or image)")
        else:
            raise InvalidInputError(f"{chunk_where}: {kind} chunks are not supported: {_CHUNKS}")
    inputs = {
        name: _tensor_from_proto(tensor, f"{where}.loss_fn_inputs[{name!r}]")
        for name, tensor in msg.loss_fn_inputs.items()
    }
    return Datum(tokens=_tokens(parts, f"{where}.model_input", bool(images)), loss_fn_inputs=inputs, images=images)


def _tokens(parts: list[np.ndarray], where: str, has_images: bool = False) -> np.ndarray:
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size == 0:
        if has_images:
            return tokens
        raise InvalidInputError(f"{where}: has no tokens")
    if tokens.min() < 0:
        raise InvalidInputError(f"{where}: holds the negative token id {int(tokens.min())}")
    return tokens


def _tensor_from_proto(msg: pb.Tensor, where: str) -> np.ndarray:
    dtype = _PROTO_DTYPES.get(msg.dtype)
    if dtype is None:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else str(msg.dtype)
        raise InvalidInputError(f"{where}: unsupported dtype {name}; send float32 or int64")
    shape = list(msg.shape) or None
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        values = _frombuffer(csr.values, dtype, f"{where} values")
        crow = _frombuffer(csr.crow_indices, np.dtype("<i8"), f"{where} crow_indices")
        col = _frombuffer(csr.col_indices, np.dtype("<i8"), f"{where} col_indices")
        array = _densify(values, shape, crow, col, where)
    else:
        array = _shaped(_frombuffer(msg.dense, dtype, where), shape, where)
    if msg.dtype == pb.DTYPE_BFLOAT16:  # bfloat16 is the upper half of a float32
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(array.dtype.newbyteorder("="), copy=False)


def _tensor_from_json(value: Any, name: str, where: str) -> np.ndarray:
    if isinstance(value, list):  # a bare list, typed by its key like the SDK does
        value = {"data": value, "dtype": _JSON_KEY_DTYPES.get(name, "float32")}
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"{where}: must be a TensorData object {{data, dtype, shape?}}")
    dtype = _JSON_DTYPES.get(value.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise InvalidInputError(f"{where}: unsupported dtype {value.get('dtype')!r}; use 'float32' or 'int64'")
    values = _json_numbers(value.get("data"), dtype, f"{where}.data")
    shape = value.get("shape")
    if shape is not None:
        shape = _json_numbers(shape, np.dtype(np.int64), f"{where}.shape").tolist()
    crow, col = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
    if crow is None and col is None:
        return _shaped(values, shape, where)
    if crow is None or col is None:
        raise InvalidInputError(f"{where}: sparse_crow_indices and sparse_col_indices come together")
    crow_array = _json_numbers(crow, np.dtype(np.int64), f"{where}.sparse_crow_indices")
    col_array = _json_numbers(col, np.dtype(np.int64), f"{where}.sparse_col_indices")
    return _densify(values, shape, crow_array, col_array, where)


def _json_numbers(values: Any, dtype: np.dtype, where: str) -> np.ndarray:
    """A flat JSON list as a 1-D array of ``dtype``: ints only for int64, ints or floats for float32."""
    if not isinstance(values, list):
        raise InvalidInputError(f"{where}: must be a list of numbers, got {type(values).__name__}")
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError) as exc:
        raise InvalidInputError(f"{where}: must be a flat list of numbers ({exc})") from exc
    if array.size == 0:
        return np.zeros(0, dtype=dtype)
    allowed = "iu" if dtype.kind == "i" else "iuf"
    if array.ndim != 1 or array.dtype.kind not in allowed:
        kind = "integers" if dtype.kind == "i" else "numbers"
        raise InvalidInputError(f"{where}: must be a flat list of {kind} (got {array.dtype} with shape {array.shape})")
    try:
        return array.astype(dtype, casting="same_kind" if dtype.kind == "f" else "safe")
    except TypeError as exc:  # e.g. uint64 ids past int64
        raise InvalidInputError(f"{where}: values do not fit {dtype}") from exc


def _frombuffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise InvalidInputError(f"{where}: {len(raw)} bytes are not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(raw, dtype=dtype)


def _checked_shape(shape: list[int], where: str) -> int:
    if any(dim < 0 for dim in shape):
        raise InvalidInputError(f"{where}: shape {shape} has a negative dimension")
    count = math.prod(shape)
    if count > MAX_TENSOR_ELEMENTS:
        raise InvalidInputError(f"{where}: shape {shape} has {count} elements, more than {MAX_TENSOR_ELEMENTS}")
    return count


def _shaped(values: np.ndarray, shape: list[int] | None, where: str) -> np.ndarray:
    if shape is None:
        return values.copy()
    count = _checked_shape(shape, where)
    if values.size != count:
        raise InvalidInputError(
            f"{where}: {values.size} values ({values.nbytes} bytes) do not fill shape {shape} ({count} values)"
        )
    return values.reshape(shape).copy()


def _densify(values: np.ndarray, shape: list[int] | None, crow: np.ndarray, col: np.ndarray, where: str) -> np.ndarray:
    """A CSR matrix as a dense array, 0 in unlisted cells, after checking the indices against the shape."""
    if shape is None or len(shape) != 2:
        raise InvalidInputError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    _checked_shape(shape, where)
    rows, cols = shape
    nnz = values.size
    if crow.size != rows + 1 or crow[0] != 0 or crow[-1] != nnz or np.any(np.diff(crow) < 0):
        raise InvalidInputError(
            f"{where}: CSR crow_indices must be {rows + 1} non-decreasing offsets from 0 to {nnz} values"
        )
    if col.size != nnz:
        raise InvalidInputError(f"{where}: CSR has {nnz} values but {col.size} col_indices")
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise InvalidInputError(f"{where}: CSR col_indices must lie in [0, {cols}) for shape {shape}")
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    if np.any((row_of[1:] == row_of[:-1]) & (col[1:] <= col[:-1])):
        raise InvalidInputError(f"{where}: CSR col_indices must increase strictly within each row")
    dense = np.zeros(shape, dtype=values.dtype)
    dense[row_of, col] = values
    return dense


def _output_array(array: Any, name: str, index: int) -> np.ndarray:
    result = np.asarray(array, dtype="<f4")
    if result.ndim == 0:
        raise ValueError(f"{name}[{index}] must have a leading (position) dimension, got a scalar")
    return np.ascontiguousarray(result)


def _trailing_shapes(fields: Mapping[str, list[np.ndarray]], index: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(arrays[index].shape[1:]) for arrays in fields.values())
