"""One run, two APIs: a Tinker client's adapter continues in the native client and the other way round.

Both APIs keep a run's checkpoints in the same store and the same files, so a
``tinker://<run>/weights/<name>`` state is the native ``twinkle://<run>/<name>``
checkpoint and vice versa. Numbers must carry over exactly: the native
``forward_only`` log-probs of a sequence equal Tinker's ``forward`` log-probs of
the same sequence (Tinker's datum is the sequence shifted by one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from tinker import types

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle_client.http import TwinkleClient

sys.path.insert(0, str(Path(__file__).parent))
from tinker_harness import BASE_MODEL, close_clients, logprobs_of, rest_client, service_client, sft_datum

pytestmark = pytest.mark.integration

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def server(start_server):
    yield start_server(["alice"])
    close_clients()


def sequence_of(datum: types.Datum) -> list[int]:
    return [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]


def native_logps(client: TwinkleClient, run_id: str, datum: types.Datum) -> np.ndarray:
    """The native log-probs of the datum's sequence: position t + 1 is Tinker's position t."""
    ids = sequence_of(datum)
    feature = make_input_feature(ids, [IGNORE_INDEX, *ids[1:]])
    output = client.call(run_id, "forward_only", inputs=[feature])
    return np.asarray(output["logps"][0], dtype=np.float64)[1:]


def test_a_tinker_run_continues_in_the_native_client(server):
    probe = sft_datum(77)
    tinker_client = service_client(server, "alice")
    trainer = tinker_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    trainer.forward_backward([sft_datum(70)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    run_id = trainer.get_info().model_id
    trainer.save_state("from-tinker").result()
    expected = logprobs_of(trainer.forward([probe], "cross_entropy").result())[0]
    tinker_client.close("success").result()  # the session ends: the run's adapter leaves the pool

    with TwinkleClient(server.url, server.keys["alice"]) as native:
        native.resume_run(run_id)  # the same run, back in the pool under the native API
        native.call(run_id, "set_optimizer", optimizer_cls="AdamW", lr=1e-2)
        native.call(run_id, "load", path=f"twinkle://{run_id}/from-tinker", load_optimizer=True)
        np.testing.assert_allclose(native_logps(native, run_id, probe), expected, atol=1e-5)
        ids = sequence_of(sft_datum(71))
        native.call(run_id, "forward_backward", inputs=[make_input_feature(ids, [IGNORE_INDEX, *ids[1:]])])
        native.call(run_id, "clip_grad_and_step")
        native.call(run_id, "save", name="from-native")
    listed = [c.checkpoint_id for c in rest_client(server, "alice").list_checkpoints(run_id).result().checkpoints]
    assert listed == ["weights/from-tinker", "weights/from-native"]


def test_a_native_checkpoint_starts_a_tinker_client(server):
    probe = sft_datum(88)
    with TwinkleClient(server.url, server.keys["alice"]) as native:
        run_id = native.create_run({"r": 4, "lora_alpha": 32, "target_modules": ALL_LINEAR}, seed=4)
        native.call(run_id, "set_optimizer", optimizer_cls="AdamW", lr=1e-2)
        ids = sequence_of(sft_datum(80))
        native.call(run_id, "forward_backward", inputs=[make_input_feature(ids, [IGNORE_INDEX, *ids[1:]])])
        native.call(run_id, "clip_grad_and_step")
        native.call(run_id, "save", name="native-state")
        expected = native_logps(native, run_id, probe)
    tinker_client = service_client(server, "alice")
    trainer = tinker_client.create_training_client_from_state_with_optimizer(
        f"tinker://{run_id}/weights/native-state"
    ).result()
    np.testing.assert_allclose(logprobs_of(trainer.forward([probe], "cross_entropy").result())[0], expected, atol=1e-5)
    trainer.forward_backward([sft_datum(81)], "cross_entropy").result()  # and it trains on from the native state
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tinker_client.close("success").result()
