"""vLLMSampler as a Ray actor, kept on the weights of a TransformersModel actor (object store, or broadcast).

Model and sampler run as actors (one CPU each) on a private local Ray that
listens on 127.0.0.1 only and is stopped at the end. ``CheckpointEngineManager``
takes its one Ray path: the payload is read in the model's actor, put in the
object store there and fetched by the sampler's actor; only a reference passes
through this driver. After a LoRA-only sync and after a merged sync, the
sampler actor's log-probs equal the trainer actor's ``forward_only`` log-probs
(float32, 1e-5). Each test runs twice: through the object store, and with
``transport="broadcast"`` (in buckets smaller than the model, over gloo here; NCCL
between GPUs), the tensors streaming into vLLM bucket by bucket.
"""

import pytest
import torch

from twinkle.data_format import SamplingParams

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in .venv-vllm")
ray = pytest.importorskip("ray", reason="Ray is not installed: `make test-vllm` installs it in .venv-vllm")

ATOL = 1e-5
PARAMS = SamplingParams(max_tokens=10, temperature=1.0, seed=11)


@pytest.fixture(scope="module", params=["object_store", "broadcast"])
def actors(request, vllm_model_dir, vllm_engine_args):
    """A TransformersModel actor with a random (non-identity) LoRA adapter, a vLLMSampler actor, and the
    transport of their syncs."""
    from peft import LoraConfig

    import twinkle
    from twinkle import DeviceGroup
    from twinkle.infra import shutdown
    from twinkle.model import TransformersModel
    from twinkle.sampler import vLLMSampler

    groups = [DeviceGroup("model", ranks=[0]), DeviceGroup("sampler", ranks=[1])]
    twinkle.initialize(mode="ray", seed=0, groups=groups, lazy_collect=True, num_cpus=2)  # both actors load at once
    try:
        model = TransformersModel(model_id=vllm_model_dir, device="cpu", remote_group="model")
        sampler = vLLMSampler(vllm_model_dir, engine_args=vllm_engine_args, remote_group="sampler")
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
        model.add_adapter_to_model("policy", lora, seed=0)
        model.set_optimizer("AdamW", lr=2e-2)
        sampler.set_template("Template", max_length=256)
        yield model, sampler, request.param
    finally:
        shutdown()
    assert not ray.is_initialized()


def test_lora_sync_from_the_model_actor_follows_the_trainer(
    actors, vllm_prompts, monkeypatch, completion_logps, logprob_gap
):
    from twinkle.checkpoint_engine import CheckpointEngineManager

    model, sampler, transport = actors
    manager = CheckpointEngineManager(model, sampler, transport=transport, bucket_mb=0.5)
    manager.sync_weights()
    before = sampler.sample(vllm_prompts[:3], PARAMS).sequences  # the only adapter samples by default
    first = logprob_gap(before, completion_logps(model, before, "policy"))
    model.forward_backward(inputs=[s.new_input_feature for s in before])  # one real step moves every LoRA weight
    model.clip_grad_and_step()
    stale = completion_logps(model, before, "policy")

    received = []  # what the driver's ray.get returns during the sync: references and None, never tensors
    real_get = ray.get

    def recording_get(*args, **kwargs):
        received.append(real_get(*args, **kwargs))
        return received[-1]

    monkeypatch.setattr(ray, "get", recording_get)
    manager.sync_weights()
    monkeypatch.undo()

    after = sampler.sample(vllm_prompts[:3], PARAMS).sequences
    measured = logprob_gap(after, completion_logps(model, after, "policy"))
    print(f"LoRA sync across actors ({transport}): max |dlogp| {first:.2e} before the step, {measured:.2e} after it")
    assert first <= ATOL and measured <= ATOL
    assert logprob_gap(before, stale) > 1e-3, "the training step changed the adapter"
    assert received and not any(_holds_tensor(value) for value in received)
    assert sampler.adapter_names == ["policy"]


def test_merged_sync_from_the_model_actor_resets_the_prefix_cache(actors, vllm_prompts, completion_logps, logprob_gap):
    from twinkle.checkpoint_engine import CheckpointEngineManager

    model, sampler, transport = actors
    # long enough to fill prefix-cache blocks; sampled from the base model first, so they hold its KV entries
    long_prompt = {"input_ids": [token for p in vllm_prompts for token in p["input_ids"]][:300]}
    base = sampler.sample(long_prompt, PARAMS, use_base_model=True).sequences
    CheckpointEngineManager(model, sampler, transport=transport, bucket_mb=0.5).sync_weights(merge_and_sync=True)
    merged = sampler.sample(long_prompt, PARAMS, use_base_model=True).sequences
    policy = sampler.sample(vllm_prompts[:3], PARAMS, use_base_model=True).sequences
    measured = max(
        logprob_gap(merged, completion_logps(model, merged, "policy")),
        logprob_gap(policy, completion_logps(model, policy, "policy")),
    )
    print(f"merged sync across actors ({transport}): max |dlogp| vs the trainer's adapted model {measured:.2e}")
    assert logprob_gap(base, completion_logps(model, base, "policy")) > 1e-3, "the policy is not the base model"
    assert measured <= ATOL


def test_streaming_out_of_an_actor_is_a_clear_error(actors, vllm_prompts):
    from twinkle.errors import ConfigurationError

    _, sampler, _ = actors
    with pytest.raises(ConfigurationError, match="cannot stream out of a Ray actor"):
        sampler.sample_stream(vllm_prompts[0], PARAMS).result()  # lazy_collect: the call's error surfaces here


def _holds_tensor(value):
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    return False
