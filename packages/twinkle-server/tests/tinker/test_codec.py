"""The Tinker codec against the SDK's own encoders and decoders (``tinker.proto``, ``tinker.types``)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types._pydantic_types.tensor_data import TensorData as JsonTensorData

from twinkle.errors import InvalidInputError
from twinkle.server.tinker.codec import datum_from_json, decode_forward_backward, encode_forward_backward_output
from twinkle.server.tinker.sampling import SampledSeq, encode_sample_response


def request(
    data: list[types.Datum], loss_fn: str = "cross_entropy", config: dict | None = None
) -> pb.ForwardBackwardRequest:
    fb_input = types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config)  # type: ignore[arg-type]
    return forward_backward_request_to_proto(
        types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id="run-1:m", seq_id=7)
    )


def top_k(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K targets and weights with empty cells (0) in the last columns, so the SDK sends them as CSR."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(1, 1000, (n, k), generator=gen)
    weights = torch.rand(n, k, generator=gen)
    targets[:, 1:] = 0
    weights[:, 1:] = 0
    return targets, weights


def sdk_data() -> list[types.Datum]:
    targets, weights = top_k(6, 8, seed=0)
    return [
        types.Datum(
            model_input=types.ModelInput(
                chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[7, 8, 9])]
            ),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10], "weights": [0.0, 0.5, 1.0, 1.0, 0.25]},
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={
                "target_tokens": np.array([2, 3, 4], dtype=np.int64),
                "logprobs": np.array([-0.5, -1.0, -2.0], dtype=np.float32),
                "advantages": torch.tensor([1.0, -1.0, 0.5]),
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(100, 106))),
            loss_fn_inputs={"target_tokens": targets, "weights": weights},
        ),
    ]


def test_decode_matches_the_sdk_request() -> None:
    data = sdk_data()
    msg = request(data, "ppo", {"clip_low_threshold": 0.7, "mode": "fast"})
    msg.forward_only = True
    assert msg.data[2].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"
    assert msg.data[2].loss_fn_inputs["weights"].WhichOneof("encoding") == "sparse_csr"
    call = decode_forward_backward(msg.SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("run-1:m", 7, "ppo", True)
    assert call.loss_fn_config == {"clip_low_threshold": 0.7, "mode": "fast"}
    assert call.data[0].tokens.tolist() == [5, 6, 7, 8, 9] and call.data[0].tokens.dtype == np.int64
    for datum, sdk in zip(call.data, data, strict=True):
        assert set(datum.loss_fn_inputs) == set(sdk.loss_fn_inputs)
        for name, tensor in sdk.loss_fn_inputs.items():
            expected = tensor.to_numpy()
            np.testing.assert_array_equal(datum.loss_fn_inputs[name], expected)
            assert datum.loss_fn_inputs[name].dtype == expected.dtype
    assert call.data[2].loss_fn_inputs["target_tokens"].shape == (6, 8)


def test_config_falls_back_to_the_legacy_map() -> None:
    msg = request(sdk_data()[:1], "dro", {"beta": 0.1})
    msg.ClearField("loss_fn_config_v2")
    assert decode_forward_backward(msg.SerializeToString()).loss_fn_config == {"beta": 0.1}
    msg.loss_fn_config_v2["beta"].number = 0.3  # v2 wins when both are set
    assert decode_forward_backward(msg.SerializeToString()).loss_fn_config == {"beta": 0.3}


@pytest.mark.parametrize("encoding", ["zstd", "ZSTD", " zstd "])
def test_zstd_body(encoding: str) -> None:
    body = request(sdk_data()).SerializeToString()
    call = decode_forward_backward(zstandard.ZstdCompressor().compress(body), encoding)
    assert len(call.data) == 3 and call.data[1].tokens.tolist() == [1, 2, 3]


def test_zstd_stream_without_content_size() -> None:
    body = request(sdk_data()).SerializeToString()
    compressor = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    compressed = compressor.compress(body) + compressor.flush()
    assert decode_forward_backward(compressed, "zstd").data[0].tokens.tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(InvalidInputError, match="inflates to more than"):
        decode_forward_backward(compressed, "zstd", max_bytes=len(body) - 1)


def test_bfloat16_and_int32_tensors() -> None:
    msg = request(sdk_data()[:1])
    values = torch.tensor([0.5, -1.25, 3.0, 0.0, 2.0], dtype=torch.bfloat16)
    weights = msg.data[0].loss_fn_inputs["weights"]
    weights.dtype, weights.dense = pb.DTYPE_BFLOAT16, values.view(torch.int16).numpy().tobytes()
    targets = msg.data[0].loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = pb.DTYPE_INT32, np.arange(5, dtype="<i4").tobytes()
    datum = decode_forward_backward(msg.SerializeToString()).data[0]
    np.testing.assert_array_equal(datum.loss_fn_inputs["weights"], values.float().numpy())
    assert datum.loss_fn_inputs["target_tokens"].dtype == np.int32


def test_datum_from_json_matches_the_proto_path() -> None:
    targets, weights = top_k(6, 8, seed=1)
    json_datum = {
        "model_input": types.ModelInput.from_ints(list(range(6))).model_dump(mode="json"),
        "loss_fn_inputs": {
            "target_tokens": JsonTensorData.from_torch_sparse(targets).model_dump(mode="json"),
            "weights": JsonTensorData.from_torch_sparse(weights).model_dump(mode="json"),
            "advantages": JsonTensorData.from_numpy(np.ones((6, 8), dtype=np.float32)).model_dump(mode="json"),
        },
    }
    assert json_datum["loss_fn_inputs"]["weights"]["sparse_crow_indices"] is not None
    datum = datum_from_json(json_datum, index=3)
    assert datum.tokens.tolist() == list(range(6))
    np.testing.assert_array_equal(datum.loss_fn_inputs["target_tokens"], targets.numpy())
    np.testing.assert_array_equal(datum.loss_fn_inputs["weights"], weights.numpy())
    assert datum.loss_fn_inputs["weights"].dtype == np.float32
    assert datum.loss_fn_inputs["target_tokens"].dtype == np.int64
    bare = datum_from_json(
        {"model_input": {"chunks": [{"tokens": [1, 2]}]}, "loss_fn_inputs": {"target_tokens": [2, 3]}}
    )
    assert bare.loss_fn_inputs["target_tokens"].dtype == np.int64


def test_forward_backward_output_round_trip() -> None:
    logps = [
        np.array([-0.1, -2.0, -0.5], dtype=np.float32),
        np.array([-1.0], dtype=np.float64),
        np.arange(8, dtype=np.float32).reshape(4, 2) * -0.5,
        np.arange(6, dtype=np.float32).reshape(2, 3) * -0.1,
        np.array([-0.3, -0.4], dtype=np.float32),
    ]
    extra = {"elementwise_loss": [-lp for lp in logps]}
    metrics = {"loss:sum": 3.5, "ratio:mean": 1.01, "clip_fraction:mean": 0.25, "tokens:max": 4}
    out = deserialize_forward_backward_output(encode_forward_backward_output(logps, metrics, extra))
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == pytest.approx(metrics)
    assert len(out.loss_fn_outputs) == len(logps)
    for datum_out, lp in zip(out.loss_fn_outputs, logps, strict=True):
        for name, expected in (("logprobs", lp), ("elementwise_loss", -lp)):
            tensor = datum_out[name]
            assert tensor.dtype == "float32" and tensor.shape == list(lp.shape)
            np.testing.assert_array_equal(tensor.to_numpy(), expected.astype(np.float32))


def test_output_is_one_record_when_shapes_agree() -> None:
    body = encode_forward_backward_output([np.zeros(3), np.zeros(5)], {"loss:sum": 0.0})
    msg = pb.ForwardBackwardOutput.FromString(body)
    assert len(msg.loss_fn_outputs) == 1 and msg.loss_fn_outputs[0].num_datums == 2
    offsets = np.frombuffer(msg.loss_fn_outputs[0].fields["logprobs"].offsets, dtype="<i8")
    assert offsets.tolist() == [0, 12, 32]  # byte offsets
    empty = deserialize_forward_backward_output(encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert empty.loss_fn_outputs == [] and empty.metrics == {"loss:sum": 0.0}


def test_sdk_chunk_merge_accepts_the_metrics() -> None:
    first = deserialize_forward_backward_output(
        encode_forward_backward_output([np.zeros(2)] * 3, {"loss:sum": 1.0, "ratio:mean": 1.0, "kl:max": 0.1})
    )
    second = deserialize_forward_backward_output(
        encode_forward_backward_output([np.zeros(2)], {"loss:sum": 2.5, "ratio:mean": 2.0, "kl:max": 0.3})
    )
    merged = combine_fwd_bwd_output_results([first, second])
    assert merged.metrics == pytest.approx({"loss:sum": 3.5, "ratio:mean": 1.25, "kl:max": 0.3})
    assert len(merged.loss_fn_outputs) == 4


@pytest.mark.parametrize("key", ["loss", "loss:median", ":sum", "a:b:sum"])
def test_bad_metric_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match="name:reduction"):
        encode_forward_backward_output([np.zeros(1)], {key: 1.0})


def test_bad_output_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="collides"):
        encode_forward_backward_output([np.zeros(1)], {}, {"logprobs": [np.zeros(1)]})
    with pytest.raises(ValueError, match="has 2 datums"):
        encode_forward_backward_output([np.zeros(1)], {}, {"loss": [np.zeros(1)] * 2})
    with pytest.raises(ValueError, match="scalar"):
        encode_forward_backward_output([np.float32(1.0)], {})


def test_sample_response_round_trip() -> None:
    sequences = [
        SampledSeq(
            tokens=[11, 12, 13],
            logprobs=[-0.1, -0.2, -0.3],
            stop_reason="stop",
            topk=[[(11, -0.1), (5, -2.5)], [(12, -0.2)], None],
        ),
        SampledSeq(tokens=[7], logprobs=None, stop_reason="length"),
    ]
    body = encode_sample_response(
        sequences,
        [None, -1.5, -0.25],
        [None, [(4, -1.5), (9, -3.0), (1, -4.0)], [(3, -0.25)]],
        prompt_cache_hit_tokens=2,
    )
    out = deserialize_sample_response(body)
    first, second = out.sequences
    assert first.tokens == [11, 12, 13] and first.stop_reason == "stop"
    assert first.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert first.topk_logprobs == [[(11, pytest.approx(-0.1)), (5, -2.5)], [(12, pytest.approx(-0.2))], None]
    assert first.topk_logprobs_np is not None and first.topk_logprobs_np.token_ids.shape == (3, 2)
    assert second.tokens == [7] and second.logprobs is None and second.stop_reason == "length"
    assert second.topk_logprobs is None
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == [-1.5, -0.25] and math.isnan(out.prompt_logprobs_np[0])
    assert out.topk_prompt_logprobs == [None, [(4, -1.5), (9, -3.0), (1, -4.0)], [(3, -0.25)]]
    assert out.prompt_cache_hit_tokens == 2
    bare = deserialize_sample_response(encode_sample_response(sequences[1:], None, None))
    assert bare.prompt_logprobs is None and bare.topk_prompt_logprobs is None


def test_bad_sample_sequences_are_refused() -> None:
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        encode_sample_response([SampledSeq(tokens=[1, 2], logprobs=[-1.0])], None, None)
    with pytest.raises(ValueError, match="stop_reason"):
        encode_sample_response([SampledSeq(tokens=[1], stop_reason="eos")], None, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top-k for 2 positions"):
        encode_sample_response([SampledSeq(tokens=[1], topk=[None, None])], None, None)


def _token_bytes(raw: bytes) -> Callable[[pb.ForwardBackwardRequest], None]:
    return lambda msg: setattr(msg.data[1].model_input[0].encoded_text, "tokens", raw)


def _tensor(msg: pb.ForwardBackwardRequest, index: int, name: str) -> pb.Tensor:
    return msg.data[index].loss_fn_inputs[name]


def _set_csr_col(msg: pb.ForwardBackwardRequest) -> None:
    csr = _tensor(msg, 2, "weights").sparse_csr
    cols = np.frombuffer(csr.col_indices, dtype="<i8").copy()
    cols[0] = 8
    csr.col_indices = cols.tobytes()


def _set_csr_crow(msg: pb.ForwardBackwardRequest) -> None:
    csr = _tensor(msg, 2, "weights").sparse_csr
    csr.crow_indices = np.frombuffer(csr.crow_indices, dtype="<i8")[:-1].tobytes()


def _set_csr_order(msg: pb.ForwardBackwardRequest) -> None:
    tensor = _tensor(msg, 2, "weights")
    tensor.sparse_csr.crow_indices = np.array([0, 2, 2, 2, 2, 2, 6], dtype="<i8").tobytes()
    tensor.sparse_csr.col_indices = np.array([3, 1, 0, 1, 2, 3], dtype="<i8").tobytes()


def _set_csr_shape(msg: pb.ForwardBackwardRequest) -> None:
    del _tensor(msg, 2, "weights").shape[:]


def _set_image(msg: pb.ForwardBackwardRequest) -> None:
    msg.data[1].model_input[0].image.data = b"\x89PNG"


def _set_dmel(msg: pb.ForwardBackwardRequest) -> None:
    msg.data[0].model_input[1].dmel.dmel = b"\x00"


def _set_empty_chunk(msg: pb.ForwardBackwardRequest) -> None:
    msg.data[1].model_input.add()


def _set_no_tokens(msg: pb.ForwardBackwardRequest) -> None:
    del msg.data[1].model_input[:]


def _set_config(msg: pb.ForwardBackwardRequest) -> None:
    msg.loss_fn_config_v2["odd"].CopyFrom(pb.LossConfigValue())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda m: setattr(_tensor(m, 0, "weights"), "dense", np.zeros(4, dtype="<f4").tobytes()),
            "data[0].loss_fn_inputs['weights']: 4 values (16 bytes) do not fill shape [5]",
        ),
        (
            lambda m: setattr(_tensor(m, 0, "weights"), "dense", b"\x00" * 7),
            "data[0].loss_fn_inputs['weights']: 7 bytes are not a whole number of 4-byte values",
        ),
        (
            lambda m: setattr(_tensor(m, 1, "logprobs"), "dtype", pb.DTYPE_UNSPECIFIED),
            "data[1].loss_fn_inputs['logprobs']: unsupported dtype DTYPE_UNSPECIFIED",
        ),
        (
            lambda m: setattr(_tensor(m, 1, "logprobs"), "dtype", 42),
            "data[1].loss_fn_inputs['logprobs']: unsupported dtype 42",
        ),
        (_set_csr_col, "data[2].loss_fn_inputs['weights']: CSR col_indices must lie in [0, 8)"),
        (_set_csr_crow, "data[2].loss_fn_inputs['weights']: CSR crow_indices must be 7 non-decreasing"),
        (_set_csr_order, "data[2].loss_fn_inputs['weights']: CSR col_indices must increase strictly"),
        (_set_csr_shape, "data[2].loss_fn_inputs['weights']: a sparse CSR tensor needs a 2-D shape"),
        (_set_image, "data[1].model_input[0].format: must be one of ('png', 'jpeg'), got ''"),
        (_set_dmel, "data[0].model_input[1]: dmel chunks are not supported"),
        (_set_empty_chunk, "data[1].model_input[1]: empty chunk"),
        (_set_no_tokens, "data[1].model_input: has no tokens"),
        (_token_bytes(b"\x01\x00\x00"), "data[1].model_input[0].tokens: 3 bytes"),
        (_token_bytes(np.array([1, -3], "<i4").tobytes()), "data[1].model_input: holds the negative token id -3"),
        (_set_config, "loss_fn_config_v2['odd']: holds neither"),
    ],
)
def test_malformed_requests_name_the_field(mutate: Callable[[pb.ForwardBackwardRequest], None], message: str) -> None:
    msg = request(sdk_data())
    mutate(msg)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        decode_forward_backward(msg.SerializeToString())


def test_image_chunks_stay_encoded_at_their_offset_on_both_paths() -> None:
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=2)
    text = types.EncodedTextChunk(tokens=[5, 6, 7])
    model_input = types.ModelInput(chunks=[text, image, types.EncodedTextChunk(tokens=[8])])
    datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [1] * 6})
    (proto,) = decode_forward_backward(request([datum]).SerializeToString()).data
    json_datum = datum_from_json({"model_input": model_input.model_dump(mode="json"), "loss_fn_inputs": {}})
    for decoded, where in ((proto, "data[0].model_input[1]"), (json_datum, "data[0].model_input.chunks[1]")):
        assert decoded.tokens.tolist() == [5, 6, 7, 8]  # text only, until the server expands the image
        (wire,) = decoded.images
        assert (wire.offset, wire.data, wire.format, wire.expected_tokens, wire.where) == (
            3,
            b"\x89PNG",
            "png",
            2,
            where,
        )


def test_image_asset_pointers_are_refused_naming_the_chunk() -> None:
    pointer = {"type": "image_asset_pointer", "format": "png", "location": "s3://bucket/cat.png"}
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}, pointer]}, "loss_fn_inputs": {}}
    with pytest.raises(InvalidInputError, match=re.escape("data[0].model_input.chunks[1]: image_asset_pointer")):
        datum_from_json(datum)


@pytest.mark.parametrize(
    ("body", "encoding", "message"),
    [
        (b"\xff\xff\xff", None, "not a ForwardBackwardRequest protobuf"),
        (b"not zstd at all", "zstd", "not valid zstd"),
        (b"", "gzip", "unsupported Content-Encoding 'gzip'"),
    ],
)
def test_bad_bodies(body: bytes, encoding: str | None, message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        decode_forward_backward(body, encoding)


def _weights(**tensor: object) -> dict:
    """A one-token JSON datum whose ``weights`` input is ``tensor``."""
    return {"model_input": {"chunks": [{"tokens": [1]}]}, "loss_fn_inputs": {"weights": tensor}}


_WEIGHTS = "data[4].loss_fn_inputs['weights']"


@pytest.mark.parametrize(
    ("datum", "message"),
    [
        ([], "data[4]: a datum must be an object"),
        ({"model_input": []}, "data[4].model_input: must be an object with a 'chunks' list"),
        (
            {"model_input": {"chunks": [{"type": "image_asset_pointer", "format": "png", "location": "s3://x"}]}},
            "data[4].model_input.chunks[0]: image_asset_pointer chunks are not supported",
        ),
        ({"model_input": {"chunks": [{"type": "audio"}]}}, "data[4].model_input.chunks[0]: not a model input chunk"),
        ({"model_input": {"chunks": [{"tokens": [1.5]}]}}, "chunks[0].tokens: must be a flat list of integers"),
        ({"model_input": {"chunks": [{"tokens": [1]}]}, "loss_fn_inputs": []}, "data[4].loss_fn_inputs: must be"),
        (
            {"model_input": {"chunks": [{"tokens": [1]}]}, "loss_fn_inputs": {"target_tokens": [1.5]}},
            "data[4].loss_fn_inputs['target_tokens'].data: must be a flat list of integers",
        ),
        (_weights(data=[[1.0]], dtype="float32"), f"{_WEIGHTS}.data: must be a flat list of numbers"),
        (_weights(data=[1.0], dtype="float16"), f"{_WEIGHTS}: unsupported dtype 'float16'"),
        (_weights(data=[1.0], dtype="float32", shape=[2]), f"{_WEIGHTS}: 1 values (4 bytes) do not fill shape [2]"),
        (
            _weights(data=[1.0], dtype="float32", shape=[1, 2], sparse_crow_indices=[0, 1]),
            f"{_WEIGHTS}: sparse_crow_indices and sparse_col_indices come together",
        ),
        (
            _weights(data=[1.0], dtype="float32", shape=[1, 2], sparse_crow_indices=[0, 1], sparse_col_indices=[2]),
            f"{_WEIGHTS}: CSR col_indices must lie in [0, 2)",
        ),
        ({"model_input": {"chunks": [{"tokens": [1]}]}, "loss_fn_inputs": {"weights": "x"}}, "TensorData object"),
    ],
)
def test_malformed_json_datums(datum: object, message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        datum_from_json(datum, index=4)  # type: ignore[arg-type]
