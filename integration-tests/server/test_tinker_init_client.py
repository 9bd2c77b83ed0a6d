"""``init_tinker_client`` then the unmodified ``tinker`` SDK, with no arguments, against a real ``twinkle server``.

The data are Twinkle ``InputFeature``s converted by ``input_feature_to_datum``,
and checkpoints are named in the native ``twinkle://`` form wherever the SDK
takes a path. The environment is restored when the module ends, so the other
Tinker SDK tests (explicit URLs and keys, ``tinker://`` paths) run unaffected
in the same process.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from twinkle.data_format import IGNORE_INDEX, InputFeature, make_input_feature
from twinkle_client import datum_to_input_feature, init_tinker_client, input_feature_to_datum

sys.path.insert(0, str(Path(__file__).parent))
from tinker_harness import BASE_MODEL, logprobs_of, weights_of

pytestmark = pytest.mark.integration

ENV_VARS = ("TINKER_BASE_URL", "TINKER_API_KEY", "TWINKLE_BASE_URL", "TWINKLE_API_KEY", "TINKER_CREDENTIAL_CMD")
PROMPT = types.ModelInput.from_ints([151644, 872, 198, 9707])
SAMPLING = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["alice"])


@pytest.fixture(scope="module")
def service(server) -> Iterator[tinker.ServiceClient]:
    """A ``ServiceClient()`` built from nothing but what ``init_tinker_client`` set up."""
    with pytest.MonkeyPatch.context() as env:  # undone at module end
        for name in ENV_VARS:
            env.delenv(name, raising=False)
        init_tinker_client(server.url, server.keys["alice"])
        client = tinker.ServiceClient()
        yield client
        client.close("success").result()


@pytest.fixture(scope="module")
def trained(service):
    """A LoRA run after one forward_backward + optim_step on converted features: (client, run id, fwdbwd output)."""
    trainer = service.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
    data = [input_feature_to_datum(feature) for feature in features()]
    output = trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return trainer, trainer.get_info().model_id, output, data


def features() -> list[InputFeature]:
    """Two prompt/answer features: the first half of each sequence is prompt (not trained)."""
    rows = [[151644, 872, 198, 9707, 11, 1879, 0, 151645], [151644, 872, 198, 14990, 1879, 151645]]
    return [make_input_feature(ids, [IGNORE_INDEX] * (len(ids) // 2) + ids[len(ids) // 2 :]) for ids in rows]


def test_converted_features_train_with_the_weights_their_labels_give(trained):
    _, _, output, data = trained
    for datum, feature in zip(data, features(), strict=True):
        assert weights_of(datum).tolist() == [float(label != IGNORE_INDEX) for label in feature["labels"][1:]]
        assert datum_to_input_feature(datum) == feature
    logprobs = logprobs_of(output)
    assert [len(lp) for lp in logprobs] == [7, 5]
    expected = -sum(float((lp * weights_of(datum)).sum()) for lp, datum in zip(logprobs, data, strict=True))
    assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_a_state_saved_over_tinker_loads_from_its_twinkle_path(service, trained):
    trainer, run_id, _, data = trained
    assert trainer.save_state("x").result().path == f"tinker://{run_id}/weights/x"
    native = f"twinkle://{run_id}/x"
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(native)
    assert (parsed.tinker_path, parsed.training_run_id) == (f"tinker://{run_id}/weights/x", run_id)
    assert tinker.RestClient().get_training_run_by_tinker_path(native).result().training_run_id == run_id
    resumed = service.create_training_client_from_state(native).result()
    assert resumed.get_info().model_id != run_id
    want = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(want, rel=1e-6)


def test_sampler_weights_sample_from_their_twinkle_path(service, trained):
    trainer, run_id, _, _ = trained
    assert trainer.save_weights_for_sampler("s").result().path == f"tinker://{run_id}/sampler_weights/s"
    native = service.create_sampling_client(model_path=f"twinkle://{run_id}/sampler_weights/s").result()
    assert native.get_base_model() == BASE_MODEL
    via_tinker = service.create_sampling_client(model_path=f"tinker://{run_id}/sampler_weights/s").result()
    via_trainer = trainer.create_sampling_client(f"twinkle://{run_id}/sampler_weights/s").result()
    results = [c.sample(PROMPT, num_samples=2, sampling_params=SAMPLING).result() for c in (native, via_tinker)]
    results.append(via_trainer.sample(PROMPT, num_samples=2, sampling_params=SAMPLING).result())
    tokens = [[s.tokens for s in result.sequences] for result in results]
    assert tokens[0] == tokens[1] == tokens[2]  # the same weights under either path, the same seed
    assert all(1 <= len(t) <= 4 for t in tokens[0])
    logprobs = native.compute_logprobs(types.ModelInput.from_ints([*PROMPT.to_ints(), *tokens[0][0]])).result()
    assert np.isfinite(np.array(logprobs[1:], dtype=np.float64)).all()


def test_the_server_logged_no_errors(server, trained):
    assert server.errors() == []
