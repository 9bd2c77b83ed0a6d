import json
import math
import struct

import numpy as np
import pytest

from twinkle import wire
from twinkle.data_format import ModelOutput, SampledSequence, SampleResponse, SamplingParams, make_input_feature
from twinkle.errors import InvalidInputError

NAN, INF = float("nan"), float("inf")


def header(data: bytes) -> dict:
    (length,) = struct.unpack_from("<I", data, 4)
    return json.loads(data[8 : 8 + length])


def same(a, b) -> bool:
    """Equal including types, NaN and the sign of zero (``repr`` shows all three)."""
    return repr(a) == repr(b)


def test_nested_number_lists_round_trip_exactly_and_long_ones_travel_as_buffers():
    value = {
        "input_ids": [list(range(100, 120)), [7] * 8, [1, 2, 3]],
        "logps": [-0.1 * i for i in range(9)] + [NAN, INF, -INF, -0.0, 5e-324, 1.7976931348623157e308],
        "short": [1.5, NAN, -0.0],
        "scalars": {"nan": NAN, "inf": INF, "minus_inf": -INF, "minus_zero": -0.0, "int": -(2**62)},
        "huge_ints": [2**70] * 10,
        "mixed": [1, 2.0] * 5,
        "bools": [True, False] * 5,
        "text": ["héllo", "", "你好"],
        "none": None,
    }
    data = wire.encode(value)
    assert same(wire.decode(data), value)
    tree = header(data)["value"]
    assert tree["input_ids"][0] == {"__twk__": "array", "buffer": 0, "dtype": "int64", "shape": [20], "kind": "list"}
    assert tree["input_ids"][1]["kind"] == "list"
    assert tree["input_ids"][2] == [1, 2, 3]  # fewer than 8 numbers stay JSON
    assert tree["logps"]["dtype"] == "float64"
    assert tree["short"][1] == {"__twk__": "float", "value": "nan"}
    for key in ("huge_ints", "mixed", "bools"):  # beyond int64, mixed, or bools: not packed
        assert isinstance(tree[key], list)


def test_tuples_become_lists_and_dicts_with_the_tag_key_survive():
    value = {"__twk__": "user data", "pair": (1, "a"), "inner": {"__twk__": [1.0] * 8}}
    assert wire.decode(wire.encode(value)) == {
        "__twk__": "user data",
        "pair": [1, "a"],
        "inner": {"__twk__": [1.0] * 8},
    }


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "bool"])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4), (3, 1, 2)])
def test_numpy_arrays_of_every_wire_dtype_and_shape_round_trip(dtype, shape):
    rng = np.random.default_rng(0)
    array = np.asarray(rng.standard_normal(shape) * 1000).astype(dtype)
    decoded = wire.decode(wire.encode({"a": array}))["a"]
    assert isinstance(decoded, np.ndarray)
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, array)
    decoded[...] = 0  # decoded arrays are writable, not views of the request bytes


def test_float_arrays_keep_non_finite_values_and_odd_layouts_are_normalised():
    values = np.array([[NAN, INF], [-INF, -0.0]], dtype=np.float32)
    big_endian_transposed = np.arange(12, dtype=">i8").reshape(3, 4).T
    decoded = wire.decode(wire.encode([values, big_endian_transposed]))
    np.testing.assert_array_equal(decoded[0], values)
    assert np.signbit(decoded[0][1, 1])
    np.testing.assert_array_equal(decoded[1], np.arange(12).reshape(3, 4).T)
    assert decoded[1].dtype == np.dtype("<i8")


def test_float16_arrays_and_numpy_scalars():
    decoded = wire.decode(wire.encode({"half": np.array([0.5, 1.5], dtype=np.float16), "scalar": np.float32(2.5)}))
    assert decoded["half"].dtype == np.float32
    np.testing.assert_array_equal(decoded["half"], [0.5, 1.5])
    assert same(decoded["scalar"], 2.5)


def test_torch_tensors_are_duck_typed_and_decode_to_numpy():
    torch = pytest.importorskip("torch")
    logps = torch.tensor([[-0.5, -1.25], [NAN, -INF]], requires_grad=True) * 2
    value = {"logps": logps, "ids": torch.arange(10), "mask": torch.tensor([True, False]), "bf16": logps.bfloat16()}
    data = wire.encode(value)
    decoded = wire.decode(data)
    np.testing.assert_array_equal(decoded["logps"], logps.detach().numpy())
    np.testing.assert_array_equal(decoded["ids"], np.arange(10))
    assert decoded["mask"].dtype == np.bool_
    assert decoded["bf16"].dtype == np.float32
    np.testing.assert_array_equal(decoded["bf16"], logps.detach().bfloat16().float().numpy())
    tree = header(data)["value"]
    assert tree["logps"]["kind"] == "torch"
    assert tree["bf16"]["dtype"] == "float32"


def test_data_format_dataclasses_round_trip_through_from_dict():
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=["\n", 7], seed=3)
    feature = make_input_feature(list(range(12)), labels=[-100] * 4 + list(range(4, 12)), user_data={"answer": "4"})
    response = SampleResponse(
        sequences=[
            SampledSequence(
                tokens=list(range(4, 12)), stop_reason="stop", logprobs=[-0.25] * 8, new_input_feature=feature
            )
        ],
        prompt_token_ids=[[0, 1, 2, 3]],
    )
    output = ModelOutput(loss=1.5, logps=[np.full(3, -0.5, np.float32), np.zeros(0, np.float32)], num_tokens=3)
    decoded_params, decoded_response, decoded_output = wire.decode(wire.encode([params, response, output]))
    assert decoded_params == params
    assert decoded_response == response
    assert isinstance(decoded_response.sequences[0], SampledSequence)
    assert isinstance(decoded_output, ModelOutput)
    assert (decoded_output.loss, decoded_output.num_tokens) == (1.5, 3)
    np.testing.assert_array_equal(decoded_output.logps[0], output.logps[0])
    assert decoded_output.logps[1].shape == (0,)


def test_big_payloads_cost_about_their_raw_bytes():
    logps = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    ids = list(range(200_000))
    data = wire.encode({"logps": logps, "ids": ids})
    raw = logps.nbytes + 8 * len(ids)
    assert raw <= len(data) < raw + 1024
    assert len(data) * 3 < len(json.dumps({"logps": logps.tolist(), "ids": ids}))
    decoded = wire.decode(data)
    np.testing.assert_array_equal(decoded["logps"], logps)
    assert decoded["ids"] == ids


def test_buffers_are_aligned_to_eight_bytes():
    data = wire.encode({"a": np.ones(3, np.bool_), "b": np.ones(3, np.float64), "c": [1.0] * 9})
    (length,) = struct.unpack_from("<I", data, 4)
    assert (8 + length) % 8 == 0
    assert all(offset % 8 == 0 for offset, _ in header(data)["buffers"])


def test_without_numpy_arrays_decode_to_nested_lists(monkeypatch):
    data = wire.encode({"m": np.arange(6, dtype=np.int32).reshape(2, 3), "s": np.array(1.5), "e": np.zeros((2, 0))})
    monkeypatch.setattr(wire, "np", None)
    assert wire.decode(data) == {"m": [[0, 1, 2], [3, 4, 5]], "s": 1.5, "e": [[], []]}
    assert wire.decode(wire.encode([0.5] * 8)) == [0.5] * 8


def test_without_numpy_tensors_still_encode(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(wire, "np", None)
    data = wire.encode(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    assert wire.decode(data) == [[1, 2], [3, 4]]


def _body(value: dict, buffers: bytes = b"") -> bytes:
    text = json.dumps(value).encode()
    return b"TWK1" + struct.pack("<I", len(text)) + text + buffers


def _array(**overrides) -> dict:
    return {"__twk__": "array", "buffer": 0, "dtype": "float32", "shape": [2], "kind": "numpy", **overrides}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"method": "step"}', r"not a Twinkle body: expected magic b'TWK1'"),
        (b"TWK1\x01", "not a Twinkle body"),
        (b"TWK1" + struct.pack("<I", 100) + b"{}", "truncated header: it declares 100 bytes but only 2 follow"),
        (b"TWK1" + struct.pack("<I", 3) + b"{x}", "header is not UTF-8 JSON"),
        (b"TWK1" + struct.pack("<I", 2) + b"\xff\xfe", "header is not UTF-8 JSON"),
        (_body({"value": 1}), "must be a JSON object with 'value' and a 'buffers' list"),
        (_body({"value": 1, "buffers": [[0, 8]]}, b"1234"), r"buffer 0 \[0, 8\] is out of range of the 4-byte"),
        (_body({"value": 1, "buffers": [[0]]}), r"buffer 0 must be \[offset, nbytes\]"),
        (_body({"value": _array(buffer=1), "buffers": [[0, 8]]}, bytes(8)), "names buffer 1; the body has 1"),
        (_body({"value": _array(dtype="uint8"), "buffers": [[0, 8]]}, bytes(8)), "unsupported dtype 'uint8'"),
        (_body({"value": _array(shape=[-1]), "buffers": [[0, 8]]}, bytes(8)), r"invalid shape \[-1\]"),
        (_body({"value": _array(kind="jax"), "buffers": [[0, 8]]}, bytes(8)), "kind 'jax'"),
        (_body({"value": _array(shape=[3]), "buffers": [[0, 8]]}, bytes(8)), r"float32 \[3\] \(12 bytes\)"),
        (_body({"value": {"x": {"__twk__": "float", "value": "1"}}, "buffers": []}), r"malformed __twk__ leaf at \$.x"),
        (_body({"value": {"__twk__": "dataclass", "type": "os", "data": {}}, "buffers": []}), "unknown dataclass"),
        (_body({"value": {"__twk__": "dataclass", "type": "SamplingParams", "data": {"x": 1}}, "buffers": []}), "x"),
    ],
)
def test_malformed_bodies_raise_invalid_input_naming_the_problem(data, message):
    with pytest.raises(InvalidInputError, match=message):
        wire.decode(data)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"a": [{1, 2}]}, r"cannot encode set at \$.a\[0\]"),
        ({"a": {3: "x"}}, r"dict keys must be strings, got int key 3 at \$.a"),
        ({"a": np.zeros(2, np.uint8)}, r"unsupported dtype 'uint8' at \$.a"),
        (object(), r"cannot encode object at \$"),
    ],
)
def test_values_that_cannot_travel_are_rejected_with_their_path(value, message):
    with pytest.raises(InvalidInputError, match=message):
        wire.encode(value)


def test_decoded_scalars_keep_python_types():
    decoded = wire.decode(wire.encode({"f": 1.0, "i": 1, "b": True, "nan": NAN}))
    assert [type(decoded[k]) for k in ("f", "i", "b")] == [float, int, bool]
    assert math.isnan(decoded["nan"])
