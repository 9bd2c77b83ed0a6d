"""``twinkle_client.tinker``: the InputFeature/Datum converters, path translation, and the SDK preparation.

Everything here runs without a server; the SDK's clients against a real one are
in ``integration-tests/server/test_tinker_init_client.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.errors import InvalidInputError, MissingDependencyError
from twinkle_client import datum_to_input_feature, init_tinker_client, input_feature_to_datum, to_tinker_path

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.lib._auth_token_provider import ApiKeyAuthProvider, resolve_auth_provider  # noqa: E402
from tinker.lib.base_url import resolve_base_url  # noqa: E402
from tinker.lib.internal_client_holder import InternalClientHolder  # noqa: E402

ENV_VARS = ("TINKER_BASE_URL", "TINKER_API_KEY", "TWINKLE_BASE_URL", "TWINKLE_API_KEY", "TINKER_CREDENTIAL_CMD")
NO = IGNORE_INDEX  # a label that is not trained


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No URL or key variables set; whatever a test or init_tinker_client sets is undone afterwards."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def datum(tokens: list[int], weights: Any = None, targets: Any = None) -> types.Datum:
    inputs: dict[str, Any] = {"target_tokens": tokens[1:] if targets is None else targets}
    if weights is not None:
        inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


# ----------------------------------------------------------------- imports


def run_python(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)


def test_importing_twinkle_client_and_its_tinker_package_does_not_import_tinker():
    script = (
        "import sys, twinkle_client; assert 'tinker' not in sys.modules; "
        "from twinkle_client import *; import twinkle_client.tinker; from twinkle_client import to_tinker_path; "
        "assert 'tinker' not in sys.modules, sorted(m for m in sys.modules if m.startswith('tinker'))"
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr


def test_without_tinker_the_functions_name_the_extra_to_install():
    script = (
        "import sys; sys.modules['tinker'] = None\n"  # makes `import tinker` fail as if not installed
        "from twinkle import init_tinker_client\n"
        "try:\n    init_tinker_client('http://127.0.0.1:1')\n"
        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    result = run_python(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MissingDependencyError")
    assert "pip install 'twinkle-client[tinker]'" in result.stdout
    assert issubclass(MissingDependencyError, ImportError)


def test_the_twinkle_namespace_exports_the_same_function():
    from twinkle import init_tinker_client as from_core
    from twinkle_client.tinker import init_tinker_client as from_package

    assert from_core is from_package is init_tinker_client


# ----------------------------------------------------------------- converters


def test_feature_to_datum_shifts_tokens_and_weights_the_trained_targets():
    feature = make_input_feature([10, 11, 12, 13, 14], [NO, NO, 12, 13, NO])
    result = input_feature_to_datum(feature)
    assert result.model_input.to_ints() == [10, 11, 12, 13]
    targets, weights = result.loss_fn_inputs["target_tokens"], result.loss_fn_inputs["weights"]
    assert (targets.dtype, weights.dtype) == ("int64", "float32")
    assert targets.tolist() == [11, 12, 13, 14]
    assert weights.tolist() == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "labels",
    [[NO, NO, 12, 13, NO], [NO, 11, 12, 13, 14], [NO, NO, NO, NO, NO], [NO, 11, NO, 13, NO]],
)
def test_feature_round_trip_is_exact_when_the_first_label_is_ignored(labels):
    feature = make_input_feature([10, 11, 12, 13, 14], labels)
    assert datum_to_input_feature(input_feature_to_datum(feature)) == feature


def test_datum_round_trip_is_exact():
    original = datum([5, 6, 7, 8, 9], weights=[0.0, 1.0, 0.0, 1.0])
    again = input_feature_to_datum(datum_to_input_feature(original))
    assert again.model_input == original.model_input
    for name in ("target_tokens", "weights"):
        assert again.loss_fn_inputs[name].dtype == original.loss_fn_inputs[name].dtype
        np.testing.assert_array_equal(again.loss_fn_inputs[name].to_numpy(), original.loss_fn_inputs[name].to_numpy())


def test_labels_come_from_the_loss_mask_or_nothing_is_trained():
    from_mask = input_feature_to_datum({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})
    assert from_mask.loss_fn_inputs["weights"].tolist() == [1.0, 1.0]
    ids_only = input_feature_to_datum({"input_ids": np.array([1, 2, 3])})
    assert ids_only.loss_fn_inputs["weights"].tolist() == [0.0, 0.0]


def test_a_datum_without_weights_trains_every_target_and_other_inputs_are_left_out():
    rl = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "advantages": [0.5, -0.5], "logprobs": [-1.0, -2.0]},
    )
    feature = datum_to_input_feature(rl)
    assert feature == make_input_feature([1, 2, 3], [NO, 2, 3])


def test_a_feature_encoded_by_the_builtin_template_round_trips(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("transformers")
    template_module = pytest.importorskip("twinkle.template")
    from twinkle.hub import resolve_model

    with pytest.MonkeyPatch.context() as patch:  # build the builtin model in a throwaway cache unless one is set
        if "TWINKLE_CACHE_DIR" not in os.environ:
            patch.setenv("TWINKLE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        template = template_module.Template(resolve_model("builtin://qwen3-tiny"), max_length=None)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    feature = template.encode({"messages": messages})
    assert feature["labels"][0] == NO
    converted = input_feature_to_datum(feature)
    targets = converted.loss_fn_inputs["target_tokens"].tolist()
    trained = [t for t, w in zip(targets, converted.loss_fn_inputs["weights"].tolist(), strict=True) if w]
    assert trained == [label for label in feature["labels"] if label != NO]
    back = datum_to_input_feature(converted)
    for name in ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids", "length"):
        assert back[name] == feature[name], name


@pytest.mark.parametrize(
    ("feature", "message"),
    [
        ({"input_ids": []}, "input_ids is empty"),
        ({"input_ids": [7]}, "at least 2"),
        ({"input_ids": [1, 2, 3], "labels": [NO, 5, 3]}, "labels must be unshifted"),
        ({"input_ids": [1, 2, 3], "labels": [NO, 2, 3], "loss_mask": [0, 0, 1]}, "disagrees"),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}, "only 0 and 1"),
        ({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 0]}, "padding"),
        ({"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 0, 1]}, "packed"),
        ("not a feature", "must be a dict"),
    ],
)
def test_bad_features_raise_invalid_input(feature, message):
    with pytest.raises(InvalidInputError, match=message):
        input_feature_to_datum(feature)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (datum([1, 2, 3], targets=[5, 3]), r"\['target_tokens'\]\[0\]=5 but model_input\[1\]=2"),
        (datum([1, 2, 3], targets=np.array([[2, 0], [3, 0]], dtype=np.int64)), "only 1-D"),
        (datum([1, 2, 3], targets=[2, 3, 4]), "has 3 values but model_input has 2"),
        (datum([1, 2, 3], weights=[0.5, 1.0]), "can only train"),
        (datum([1, 2, 3], weights=[1.0]), "has 1 values"),
        (datum([1, 2, 3], targets=np.array([2.0, 3.0], dtype=np.float32)), "integer token ids"),
        (types.Datum(model_input=types.ModelInput.from_ints([]), loss_fn_inputs={}), "empty"),
        (types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={}), "no 'target_tokens'"),
        ({"input_ids": [1, 2]}, "expected a tinker.types.Datum"),
    ],
)
def test_bad_datums_raise_invalid_input(bad, message):
    with pytest.raises(InvalidInputError, match=message):
        datum_to_input_feature(bad)


# ----------------------------------------------------------------- paths


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("twinkle://s1:train:0/step-1", "tinker://s1:train:0/weights/step-1"),
        ("twinkle://s1:train:0/sampler_weights/final", "tinker://s1:train:0/sampler_weights/final"),
        ("tinker://s1:train:0/weights/step-1", "tinker://s1:train:0/weights/step-1"),
        ("hf://Qwen/Qwen3-0.6B", "hf://Qwen/Qwen3-0.6B"),
    ],
)
def test_to_tinker_path(path, expected):
    assert to_tinker_path(path) == expected


@pytest.mark.parametrize(
    "path", ["twinkle://", "twinkle://run", "twinkle://run/", "twinkle://run/a/b", "twinkle://run/sampler_weights"]
)
def test_malformed_twinkle_paths_raise_a_value_error_in_twinkle_terms(path):
    with pytest.raises(InvalidInputError, match="expected 'twinkle://<run_id>/<name>'"):
        to_tinker_path(path)


# ----------------------------------------------------------------- init_tinker_client


def test_the_native_clients_variables_are_the_fallbacks(env):
    env.setenv("TWINKLE_BASE_URL", "http://twinkle.example:9000/twinkle/v1/")
    env.setenv("TWINKLE_API_KEY", "tml-native-key-0123456789")
    init_tinker_client()
    assert resolve_base_url() == "http://twinkle.example:9000"  # what a ServiceClient() without arguments uses
    assert ApiKeyAuthProvider.create_or_env().api_key == "tml-native-key-0123456789"


def test_existing_tinker_variables_win_over_the_native_ones_and_arguments_over_both(env):
    env.setenv("TINKER_BASE_URL", "http://tinker-env:1")
    env.setenv("TWINKLE_BASE_URL", "http://twinkle-env:2")
    env.setenv("TINKER_API_KEY", "tml-tinker-env-key-0123")
    env.setenv("TWINKLE_API_KEY", "tml-twinkle-env-key-0123")
    init_tinker_client()
    assert resolve_base_url() == "http://tinker-env:1"
    assert ApiKeyAuthProvider.create_or_env().api_key == "tml-tinker-env-key-0123"
    init_tinker_client("http://argument:3", "tml-argument-key-0123456")
    assert resolve_base_url() == "http://argument:3"
    assert ApiKeyAuthProvider.create_or_env().api_key == "tml-argument-key-0123456"


def test_without_anything_the_native_default_url_is_used_and_no_key_is_set(env):
    init_tinker_client()
    assert resolve_base_url() == "http://127.0.0.1:8000"
    assert "TINKER_API_KEY" not in os.environ


def test_patches_are_applied_once(env):
    init_tinker_client("http://127.0.0.1:1")
    patched = (
        types.ParsedCheckpointTinkerPath.from_tinker_path.__func__,
        InternalClientHolder._create_sampling_session,
        ApiKeyAuthProvider.__init__,
    )
    init_tinker_client("http://127.0.0.1:2")
    assert patched == (
        types.ParsedCheckpointTinkerPath.from_tinker_path.__func__,
        InternalClientHolder._create_sampling_session,
        ApiKeyAuthProvider.__init__,
    )
    assert all(getattr(function, "__twinkle_patched__", False) for function in patched)
    assert not hasattr(patched[0].__wrapped__, "__twinkle_patched__")  # a patch never wraps another


def test_parsed_checkpoint_paths_accept_twinkle_paths_and_keep_tinker_ones(env):
    init_tinker_client("http://127.0.0.1:1")
    parse = types.ParsedCheckpointTinkerPath.from_tinker_path
    native = parse("twinkle://s:train:0/ckpt")
    assert (native.tinker_path, native.training_run_id, native.checkpoint_type, native.checkpoint_id) == (
        "tinker://s:train:0/weights/ckpt",
        "s:train:0",
        "training",
        "weights/ckpt",
    )
    assert parse("twinkle://s:train:0/sampler_weights/x").checkpoint_type == "sampler"
    assert parse("tinker://r/external_weights/e") == types.ParsedCheckpointTinkerPath(
        tinker_path="tinker://r/external_weights/e",
        training_run_id="r",
        checkpoint_type="external",
        checkpoint_id="external_weights/e",
    )
    for bad in ("hf://x/y", "tinker://r/other/x", "twinkle://r/a/b"):
        with pytest.raises(ValueError):
            parse(bad)


class FakeHolder:
    """Just what ``InternalClientHolder._create_sampling_session`` touches, recording the request it sends."""

    def __init__(self) -> None:
        self._sampling_client_counter = 0
        self._session_id = "session"
        self.requests: list[types.CreateSamplingSessionRequest] = []

    @contextmanager
    def _client(self) -> Iterator[Any]:
        async def create_sampling_session(request: types.CreateSamplingSessionRequest) -> Any:
            self.requests.append(request)
            return SimpleNamespace(sampling_session_id=f"sampler-{len(self.requests)}")

        yield SimpleNamespace(service=SimpleNamespace(create_sampling_session=create_sampling_session))

    def aclient(self, pool: Any) -> Any:
        return self._client()


def test_sampling_sessions_translate_twinkle_paths_and_pass_others_unchanged(env):
    init_tinker_client("http://127.0.0.1:1")
    holder = FakeHolder()
    create = InternalClientHolder._create_sampling_session
    asyncio.run(create(holder, model_path="twinkle://s:train:0/sampler_weights/w"))
    asyncio.run(create(holder, model_path="tinker://s:train:0/weights/w"))
    asyncio.run(create(holder, base_model="builtin://qwen3-tiny"))
    assert [(r.model_path, r.base_model) for r in holder.requests] == [
        ("tinker://s:train:0/sampler_weights/w", None),
        ("tinker://s:train:0/weights/w", None),
        (None, "builtin://qwen3-tiny"),
    ]
    with pytest.raises(ValueError, match="must start with 'tinker://'"):  # the SDK's own check still runs
        asyncio.run(create(holder, model_path="hf://Qwen/Qwen3"))


def test_api_keys_without_the_tml_prefix_are_accepted_as_they_are(env):
    init_tinker_client("http://127.0.0.1:1")
    for key in ("configured-key-0123456789", "tml-generated-key-0123456789"):
        provider = ApiKeyAuthProvider(key)
        assert provider.api_key == key
        assert asyncio.run(provider.get_token()) == key
        assert resolve_auth_provider(key, enforce_cmd=False).api_key == key
