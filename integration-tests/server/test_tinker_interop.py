"""One run, two APIs: a Tinker client's adapter continues in the native client and the other way round.

Both APIs keep a run's checkpoints in the same store and the same files, so a
``tinker://<run>/weights/<name>`` state is the native ``twinkle://<run>/<name>``
checkpoint and vice versa. Numbers must carry over exactly: the native
``forward_only`` log-probs of a sequence equal Tinker's ``forward`` log-probs of
the same sequence (Tinker's datum is the sequence shifted by one). A checkpoint
saved with a TTL through either API expires for both.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle_client.http import TwinkleClient

sys.path.insert(0, str(Path(__file__).parent))
from tinker_harness import BASE_MODEL, close_clients, logprobs_of, rest_client, service_client, sft_datum

pytestmark = pytest.mark.integration

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


SWEEP_INTERVAL_S = 0.5  # how often the server deletes expired checkpoints (60 s by default)


@pytest.fixture(scope="module")
def server(start_server):
    yield start_server(["alice"], checkpoint_sweep_interval_s=SWEEP_INTERVAL_S)
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


def test_a_checkpoint_saved_with_a_ttl_is_gone_after_it_through_both_apis(server):
    tinker_client, rest = service_client(server, "alice"), rest_client(server, "alice")
    trainer = tinker_client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=5).result()
    tinker_run = trainer.get_info().model_id
    prompt, params = types.ModelInput.from_ints([151644, 872, 198]), types.SamplingParams(max_tokens=2, seed=1)
    headers = server.headers("alice")
    with TwinkleClient(server.url, server.keys["alice"]) as native:
        native_run = native.create_run({"r": 2, "target_modules": ["q_proj"]}, seed=6)
        # bad TTLs are the caller's 400 and change nothing
        with pytest.raises(InvalidInputError, match="ttl_seconds must be > 0"):
            native.call(native_run, "save", name="bad", ttl_seconds=-1)
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be > 0"):
            trainer.save_state("bad", ttl_seconds=-5).result()
        native.call(native_run, "save", name="kept", ttl_seconds=3600)
        kept = trainer.save_state("kept", ttl_seconds=60).result().path
        kept_ttl = f"{server.url}/twinkle/v1/runs/{native_run}/checkpoints/kept/ttl"
        tinker_ttl = f"{server.url}/api/v1/training_runs/{tinker_run}/checkpoints/weights/kept/ttl"
        for url, value in ((kept_ttl, "soon"), (kept_ttl, 0), (tinker_ttl, -3), (tinker_ttl, [1])):
            reply = httpx.put(url, json={"ttl_seconds": value}, headers=headers, timeout=30)
            assert reply.status_code == 400 and "ttl_seconds must be" in reply.text, reply.text
        assert [c["name"] for c in native.list_checkpoints(native_run)] == ["kept"]
        assert native.list_checkpoints(native_run)[0]["expires_at"] == pytest.approx(time.time() + 3600, abs=60)
        rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()  # cleared: kept until deleted
        sampler_path = trainer.save_weights_for_sampler("short").result().path
        sampler = tinker_client.create_sampling_client(model_path=sampler_path).result()
        assert len(sampler.sample(prompt, 1, params).result().sequences) == 1  # its adapter is in the sampler now

        # 2 s TTLs, each listed with its expiry right after it is set
        native.call(native_run, "save", name="short", ttl_seconds=2)
        listed = {c["name"]: c["expires_at"] for c in native.list_checkpoints(native_run)}
        assert listed["short"] == pytest.approx(time.time() + 2, abs=1.0)
        short_state = trainer.save_state("short", ttl_seconds=2).result().path
        listed = {c.checkpoint_id: c.expires_at for c in rest.list_checkpoints(tinker_run).result().checkpoints}
        assert listed["weights/short"].timestamp() == pytest.approx(time.time() + 2, abs=1.0)
        assert listed["weights/kept"] is None
        rest.set_checkpoint_ttl_from_tinker_path(sampler_path, 2).result()  # one saved without a TTL gets one

        # expired: never served, and deleted (records and files) by the next sweep
        checkpoints = server.state_dir / "checkpoints" / "alice"
        expired_folders = [
            checkpoints / tinker_run / "short",
            checkpoints / tinker_run / "sampler_weights" / "short",
            checkpoints / native_run / "short",
        ]
        deadline = time.monotonic() + 30
        while any(folder.exists() for folder in expired_folders) and time.monotonic() < deadline:
            time.sleep(SWEEP_INTERVAL_S / 2)
        assert not any(folder.exists() for folder in expired_folders)
        assert (checkpoints / tinker_run / "kept").is_dir() and (checkpoints / native_run / "kept").is_dir()

        # the native API answers 404
        assert [c["name"] for c in native.list_checkpoints(native_run)] == ["kept"]
        for reference in (f"twinkle://{native_run}/short", f"twinkle://{tinker_run}/short"):
            with pytest.raises(ResourceNotFoundError, match="no checkpoint"):
                native.call(native_run, "load", path=reference)
        with pytest.raises(ResourceNotFoundError, match="no checkpoint"):
            native.delete_checkpoint(native_run, "short")
        with pytest.raises(ResourceNotFoundError, match="no checkpoint"):
            native.set_checkpoint_ttl(native_run, "short", 60)
    # and so does the Tinker API, for its own checkpoints and the native one
    assert [c.checkpoint_id for c in rest.list_checkpoints(tinker_run).result().checkpoints] == ["weights/kept"]
    for path in (short_state, sampler_path, f"tinker://{native_run}/weights/short"):
        with pytest.raises(tinker.NotFoundError):
            rest.get_weights_info_by_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            rest.delete_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    with pytest.raises(tinker.NotFoundError):
        tinker_client.create_training_client_from_state(short_state).result()
    with pytest.raises(tinker.NotFoundError):
        tinker_client.create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(tinker.NotFoundError):  # a sampling client made before the expiry stops serving it
        sampler.sample(prompt, 1, params).result()
    assert server.errors() == []
