"""The Tinker API under ``twinkle server --ray --replicas 2``: two identical clients, one on each replica.

Two users train the same LoRA (same seed, same data) through the unmodified
SDK; their runs land on different replicas, so every call of each (training,
snapshot and checkpoint sampling, saving, resuming with the optimizer) runs on
its own replica, and the two must agree exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).parent))
from tinker_harness import BASE_MODEL, close_clients, logprobs_of, service_client, sft_datum

pytestmark = pytest.mark.integration

USERS = ["ann", "bob"]
DATA = [sft_datum(1), sft_datum(2, length=6)]
PROMPT = types.ModelInput.from_ints([151644, 872, 198, 9707])
SAMPLING = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)


def test_tinker_clients_train_sample_and_resume_on_their_own_replicas(start_server):
    server = start_server(USERS, args=["--ray", "--replicas", "2"], max_loras=4)
    try:
        services = {user: service_client(server, user) for user in USERS}
        trainers = {
            u: s.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()
            for u, s in services.items()
        }
        runs = {user: trainer.get_info().model_id for user, trainer in trainers.items()}
        replicas = httpx.get(f"{server.url}/admin/replicas", timeout=60).json()["replicas"]
        assert sorted(r["runs"] for r in replicas) == sorted([runs[u]] for u in USERS)  # one run on each replica

        results = {user: _train_and_sample(services[user], trainer) for user, trainer in trainers.items()}
        ann, bob = results["ann"], results["bob"]
        assert ann["loss"] == pytest.approx(bob["loss"], abs=1e-5)
        assert ann["snapshot"] == bob["snapshot"] == ann["checkpoint"]  # same weights and seed: same tokens
        for key in ("after_step", "resumed", "resumed_step"):
            for got, want in zip(ann[key], bob[key], strict=True):
                np.testing.assert_allclose(got, want, atol=1e-5)
        for got, want in zip(ann["resumed"], ann["after_step"], strict=True):  # the state holds the weights
            np.testing.assert_allclose(got, want, atol=1e-5)
        assert not server.errors(), server.errors()
    finally:
        close_clients()
        server.stop()


def _train_and_sample(service: tinker.ServiceClient, trainer: tinker.TrainingClient) -> dict:
    """One step, samples of a snapshot and of a saved path, then a second step from the saved state."""
    loss = trainer.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after_step = logprobs_of(trainer.forward(DATA, "cross_entropy").result())
    snapshot = trainer.save_weights_and_get_sampling_client().result()
    sampled = snapshot.sample(PROMPT, num_samples=2, sampling_params=SAMPLING).result()
    path = trainer.save_weights_for_sampler("w1").result().path
    from_path = service.create_sampling_client(model_path=path).result()
    again = from_path.sample(PROMPT, num_samples=2, sampling_params=SAMPLING).result()
    state = trainer.save_state("s1").result().path
    resumed_trainer = service.create_training_client_from_state_with_optimizer(state).result()
    resumed = logprobs_of(resumed_trainer.forward(DATA, "cross_entropy").result())
    resumed_trainer.forward_backward(DATA, "cross_entropy").result()
    resumed_trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # Adam's moments came with the state
    return {
        "loss": loss,
        "after_step": after_step,
        "resumed": resumed,
        "snapshot": [s.tokens for s in sampled.sequences],
        "checkpoint": [s.tokens for s in again.sequences],
        "resumed_step": logprobs_of(resumed_trainer.forward(DATA, "cross_entropy").result()),
    }
