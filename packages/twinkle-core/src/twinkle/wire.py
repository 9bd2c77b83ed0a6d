"""The Twinkle wire codec: JSON structure plus raw little-endian number buffers, for HTTP bodies.

Why not plain JSON: token ids, log-probs and advantages are long number lists;
as JSON text they are several times larger than their bytes, slow to parse, and
NaN/inf cannot be written at all. Layout::

    b"TWK1" | uint32 LE header length | UTF-8 JSON header | buffers

The header is ``{"value": <tree>, "buffers": [[offset, nbytes], ...]}`` with
offsets into the buffer region. Binary leaves in the tree look like
``{"__twk__": "array", "buffer": i, "dtype": "float32", "shape": [2, 3], "kind": "numpy"}``:

- numpy arrays (``kind="numpy"``) and torch tensors (``kind="torch"``, duck-typed:
  torch is never imported here) decode to numpy arrays — nested lists when numpy
  is not installed; bfloat16/float16 travel as float32.
- lists of at least 8 ints (``int64``) or 8 floats (``float64``) travel as
  ``kind="list"`` buffers and decode to the same Python list; nested lists recurse.
- ``twinkle.data_format`` dataclasses travel as ``{"__twk__": "dataclass", ...}``
  and decode through their ``from_dict``; a non-finite float scalar as
  ``{"__twk__": "float", "value": "nan"}``; a dict that itself has a ``"__twk__"``
  key is wrapped as ``{"__twk__": "dict", "value": {...}}``.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from array import array
from typing import Any

import twinkle.data_format as data_format
from twinkle.data_format.serde import Serializable
from twinkle.errors import InvalidInputError

try:
    import numpy as np
except ImportError:  # numpy is optional: arrays then decode to nested lists
    np = None  # type: ignore[assignment]

CONTENT_TYPE = "application/vnd.twinkle.v1"
MAGIC = b"TWK1"
TAG = "__twk__"
MIN_PACKED_LIST = 8  # shorter number lists stay JSON: a buffer costs more than it saves
_ALIGN = 8  # buffers start at multiples of 8 bytes so arrays can be viewed in place
_PREFIX = len(MAGIC) + 4
_INT32_CODE = next(code for code in "il" if array(code).itemsize == 4)
# wire dtype -> (bytes per item, array-module typecode)
_DTYPES: dict[str, tuple[int, str]] = {
    "float32": (4, "f"),
    "float64": (8, "d"),
    "int64": (8, "q"),
    "int32": (4, _INT32_CODE),
    "bool": (1, "B"),
}
_SENT_AS_FLOAT32 = ("bfloat16", "float16")
_KINDS = ("numpy", "torch", "list")
_NON_FINITE = ("nan", "inf", "-inf")


def encode(obj: Any) -> bytes:
    """Serialise ``obj`` (dicts, lists, scalars, strings, arrays, tensors, data-format dataclasses)."""
    encoder = _Encoder()
    value = encoder.tree(obj, "$")
    spans, offset = [], 0
    for buffer in encoder.buffers:
        offset += -offset % _ALIGN
        spans.append([offset, len(buffer)])
        offset += len(buffer)
    header = json.dumps(
        {"value": value, "buffers": spans}, ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode("utf-8")
    header += b" " * (-(_PREFIX + len(header)) % _ALIGN)  # JSON ignores trailing spaces
    parts = [MAGIC, struct.pack("<I", len(header)), header]
    position = 0
    for (start, _), buffer in zip(spans, encoder.buffers, strict=True):
        parts.append(b"\0" * (start - position))
        parts.append(buffer)
        position = start + len(buffer)
    return b"".join(parts)


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of :func:`encode`; malformed input raises :class:`InvalidInputError` saying what is wrong."""
    view = memoryview(data)
    if len(view) < _PREFIX or bytes(view[: len(MAGIC)]) != MAGIC:
        raise InvalidInputError(
            f"wire: not a Twinkle body: expected magic {MAGIC!r} and a 4-byte header length, "
            f"got {bytes(view[:_PREFIX])!r} ({len(view)} bytes)"
        )
    (header_length,) = struct.unpack_from("<I", view, len(MAGIC))
    if _PREFIX + header_length > len(view):
        raise InvalidInputError(
            f"wire: truncated header: it declares {header_length} bytes but only {len(view) - _PREFIX} follow"
        )
    try:
        header = json.loads(bytes(view[_PREFIX : _PREFIX + header_length]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"wire: the header is not UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict) or "value" not in header or not isinstance(header.get("buffers"), list):
        raise InvalidInputError("wire: the header must be a JSON object with 'value' and a 'buffers' list")
    region = bytearray(view[_PREFIX + header_length :])  # one copy; decoded arrays are writable views of it
    spans = [_checked_span(span, index, len(region)) for index, span in enumerate(header["buffers"])]
    return _Decoder(region, spans).tree(header["value"], "$")


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[bytes] = []

    def tree(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (str, bool)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {TAG: "float", "value": repr(float(obj))}
        if isinstance(obj, dict):
            return self._dict(obj, path)
        if isinstance(obj, (list, tuple)):
            packed = self._packed_list(obj)
            return packed if packed is not None else [self.tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, Serializable) and getattr(data_format, type(obj).__name__, None) is type(obj):
            return {TAG: "dataclass", "type": type(obj).__name__, "data": self.tree(obj.to_dict(), path)}
        if np is not None and isinstance(obj, np.generic):
            return self.tree(obj.item(), path)
        if np is not None and isinstance(obj, np.ndarray):
            return self._numpy(obj, "numpy", path)
        if callable(getattr(obj, "detach", None)) and callable(getattr(obj, "numpy", None)):
            return self._tensor(obj, path)
        if np is not None and hasattr(obj, "__array__"):
            return self._numpy(np.asarray(obj), "numpy", path)
        raise InvalidInputError(
            f"wire: cannot encode {type(obj).__name__} at {path}; send dicts, lists, numbers, strings, "
            "numpy arrays, tensors or twinkle.data_format dataclasses"
        )

    def _dict(self, obj: dict[Any, Any], path: str) -> dict[str, Any]:
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise InvalidInputError(
                    f"wire: dict keys must be strings, got {type(key).__name__} key {key!r} at {path}"
                )
            out[key] = self.tree(value, f"{path}.{key}")
        return {TAG: "dict", "value": out} if TAG in obj else out

    def _packed_list(self, values: list[Any] | tuple[Any, ...]) -> dict[str, Any] | None:
        if len(values) < MIN_PACKED_LIST:
            return None
        types = set(map(type, values))  # at C speed: the usual lists are all int or all float
        if types == {int} or all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            try:
                return self._leaf(_to_bytes(array("q", values)), "int64", [len(values)], "list")
            except OverflowError:  # beyond int64: JSON keeps big ints exact
                return None
        if types == {float} or all(isinstance(v, float) for v in values):
            return self._leaf(_to_bytes(array("d", values)), "float64", [len(values)], "list")
        return None

    def _numpy(self, arr: Any, kind: str, path: str) -> dict[str, Any]:
        dtype = "float32" if arr.dtype.name in _SENT_AS_FLOAT32 else arr.dtype.name
        _check_dtype(dtype, path)
        data = arr.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes(order="C")
        return self._leaf(data, dtype, list(arr.shape), kind)

    def _tensor(self, tensor: Any, path: str) -> dict[str, Any]:
        tensor = tensor.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype in _SENT_AS_FLOAT32:
            tensor, dtype = tensor.float(), "float32"
        _check_dtype(dtype, path)
        if np is not None:
            return self._numpy(tensor.numpy(), "torch", path)
        data = _to_bytes(array(_DTYPES[dtype][1], tensor.reshape(-1).tolist()))
        return self._leaf(data, dtype, list(tensor.shape), "torch")

    def _leaf(self, data: bytes, dtype: str, shape: list[int], kind: str) -> dict[str, Any]:
        self.buffers.append(data)
        return {TAG: "array", "buffer": len(self.buffers) - 1, "dtype": dtype, "shape": shape, "kind": kind}


class _Decoder:
    def __init__(self, region: bytearray, spans: list[tuple[int, int]]) -> None:
        self.region = region
        self.spans = spans

    def tree(self, node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [self.tree(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if TAG not in node:
            return {k: self.tree(v, f"{path}.{k}") for k, v in node.items()}
        leaf = node[TAG]
        if leaf == "array":
            return self._array(node, path)
        if leaf == "float" and node.get("value") in _NON_FINITE:
            return float(node["value"])
        if leaf == "dict" and isinstance(node.get("value"), dict):
            return {k: self.tree(v, f"{path}.{k}") for k, v in node["value"].items()}
        if leaf == "dataclass":
            cls = getattr(data_format, str(node.get("type")), None)
            if not (isinstance(cls, type) and issubclass(cls, Serializable)):
                raise InvalidInputError(f"wire: unknown dataclass type {node.get('type')!r} at {path}")
            return cls.from_dict(self.tree(node.get("data"), path))
        raise InvalidInputError(f"wire: malformed {TAG} leaf at {path}: {json.dumps(node)[:200]}")

    def _array(self, node: dict[str, Any], path: str) -> Any:
        index, dtype, shape, kind = node.get("buffer"), node.get("dtype"), node.get("shape"), node.get("kind")
        if not (isinstance(index, int) and 0 <= index < len(self.spans)):
            raise InvalidInputError(f"wire: array at {path} names buffer {index!r}; the body has {len(self.spans)}")
        dtype = _check_dtype(dtype, path)
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise InvalidInputError(f"wire: array at {path} has an invalid shape {shape!r}")
        if kind not in _KINDS or (kind == "list" and len(shape) != 1):
            raise InvalidInputError(f"wire: array at {path} has kind {kind!r} and shape {shape}; kinds: {_KINDS}")
        start, nbytes = self.spans[index]
        count = math.prod(shape)
        if nbytes != count * _DTYPES[dtype][0]:
            raise InvalidInputError(
                f"wire: array at {path} is {dtype} {shape} ({count * _DTYPES[dtype][0]} bytes) "
                f"but buffer {index} holds {nbytes} bytes"
            )
        if kind != "list" and np is not None:
            wire_dtype = np.dtype(dtype).newbyteorder("<")
            if count == 0:
                return np.empty(shape, dtype=wire_dtype)
            return np.frombuffer(self.region, dtype=wire_dtype, count=count, offset=start).reshape(shape)
        values = array(_DTYPES[dtype][1])
        values.frombytes(bytes(self.region[start : start + nbytes]))
        if sys.byteorder == "big":
            values.byteswap()
        flat = [bool(v) for v in values] if dtype == "bool" else values.tolist()
        return flat if kind == "list" else _nest(flat, shape)


def _to_bytes(values: array[Any]) -> bytes:
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def _check_dtype(dtype: Any, path: str) -> str:
    if dtype not in _DTYPES:
        raise InvalidInputError(
            f"wire: unsupported dtype {dtype!r} at {path}; supported: {', '.join(_DTYPES)} (bfloat16/float16 "
            "are sent as float32)"
        )
    return str(dtype)


def _checked_span(span: Any, index: int, region_size: int) -> tuple[int, int]:
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(n, int) and n >= 0 for n in span)):
        raise InvalidInputError(f"wire: buffer {index} must be [offset, nbytes], got {span!r}")
    offset, nbytes = span
    if offset + nbytes > region_size:
        raise InvalidInputError(
            f"wire: buffer {index} [{offset}, {nbytes}] is out of range of the {region_size}-byte buffer region "
            "(truncated body?)"
        )
    return offset, nbytes


def _nest(flat: list[Any], shape: list[int]) -> Any:
    """A flat C-order list as nested lists of ``shape`` (a scalar for shape ``[]``)."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
