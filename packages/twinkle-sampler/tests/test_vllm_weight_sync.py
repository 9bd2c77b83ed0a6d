"""Weight sync from a trainer into vLLMSampler: LoRA tensors, merged weights, full parameters, the prefix cache.

After each sync the sampler's log-probs equal the *updated* trainer's
``forward_only`` log-probs (float32, 1e-5), and differ from the old ones.
"""

import pytest
import torch

from twinkle.data_format import SamplingParams

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in .venv-vllm")

ATOL = 1e-5
PARAMS = SamplingParams(max_tokens=10, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def sampler(vllm_model_dir, vllm_template, vllm_engine_args):
    from twinkle.sampler import vLLMSampler

    sampler = vLLMSampler(vllm_model_dir, engine_args=vllm_engine_args)
    sampler.set_template(vllm_template)
    return sampler


def train_one_step(model, sequences):
    """One real optimizer step on the sampled completions, so every trained weight moves."""
    model.forward_backward(inputs=[s.new_input_feature for s in sequences])
    model.clip_grad_and_step()


def test_lora_sync_from_tensors_follows_the_trainer(sampler, vllm_trainer, vllm_prompts, completion_logps, logprob_gap):
    from twinkle.checkpoint_engine import CheckpointEngineManager

    model = vllm_trainer("policy")
    model.set_optimizer("AdamW", lr=2e-2)
    manager = CheckpointEngineManager(model, sampler)
    manager.sync_weights()
    before = sampler.sample(vllm_prompts[:3], PARAMS)  # the only adapter samples by default
    assert logprob_gap(before.sequences, completion_logps(model, before.sequences, "policy")) <= ATOL
    train_one_step(model, before.sequences)
    stale = completion_logps(model, before.sequences, "policy")
    manager.sync_weights()
    after = sampler.sample(vllm_prompts[:3], PARAMS)
    measured = logprob_gap(after.sequences, completion_logps(model, after.sequences, "policy"))
    print(f"LoRA sync: max |dlogp| vs the updated trainer {measured:.2e}")
    assert measured <= ATOL
    assert logprob_gap(before.sequences, stale) > 1e-3, "the training step changed the adapter"
    # the tensors went into the sampler's private directory: one per served adapter, old versions removed
    served = 1 + sampler.base_rows_through_zero_adapter
    assert len(list(sampler._files.root.iterdir())) == served
    sampler.remove_adapter("policy")
    assert len(list(sampler._files.root.iterdir())) == served - 1


def test_merged_sync_serves_the_adapted_policy_as_the_base_model(
    sampler, vllm_trainer, vllm_prompts, completion_logps, logprob_gap
):
    from twinkle.checkpoint_engine import CheckpointEngineManager

    model = vllm_trainer("policy")
    CheckpointEngineManager(model, sampler).sync_weights(merge_and_sync=True)
    response = sampler.sample(vllm_prompts[:3], PARAMS, use_base_model=True)
    measured = logprob_gap(response.sequences, completion_logps(model, response.sequences, "policy"))
    print(f"merged sync: max |dlogp| vs the trainer's adapted model {measured:.2e}")
    assert measured <= ATOL


def test_full_parameter_sync_including_the_tied_embedding(
    sampler, vllm_trainer, vllm_prompts, completion_logps, logprob_gap
):
    from twinkle.checkpoint_engine import CheckpointEngineManager

    model = vllm_trainer()  # no adapter: every weight trains, the tied embedding / output layer too
    model.set_optimizer("AdamW", lr=1e-2)
    first = sampler.sample(vllm_prompts[:3], PARAMS, use_base_model=True)
    train_one_step(model, first.sequences)
    CheckpointEngineManager(model, sampler).sync_weights(merge_and_sync=True)
    response = sampler.sample(vllm_prompts[:3], PARAMS, use_base_model=True)
    measured = logprob_gap(response.sequences, completion_logps(model, response.sequences))
    print(f"full-parameter sync: max |dlogp| vs the updated trainer {measured:.2e}")
    assert measured <= ATOL


def test_a_sync_without_resetting_the_prefix_cache_samples_from_stale_prefixes(
    sampler, vllm_trainer, vllm_prompts, completion_logps, logprob_gap
):
    """Shown once on the raw engine: reload weights, keep the prefix cache, and a cached prompt is wrong."""
    block = sampler.llm.llm_engine.vllm_config.cache_config.block_size
    long_prompt = {"input_ids": [token for p in vllm_prompts for token in p["input_ids"]][: 2 * block + 5]}
    assert len(long_prompt["input_ids"]) > block, "the prompt fills at least one cached block"
    model = vllm_trainer()
    sampler.load_base_weights(model.model.state_dict())  # back to the trainer's start, cache reset
    sampler.sample(long_prompt, PARAMS, use_base_model=True)  # its full blocks are now cached
    with torch.no_grad():
        for param in model.model.parameters():
            param.mul_(1.05)  # the trainer moves on
    weights = list(model.model.state_dict().items())
    sampler.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    sampler.llm.collective_rpc("twinkle_retie_output_layer")
    stale = sampler.sample(long_prompt, PARAMS, use_base_model=True)
    stale_gap = logprob_gap(stale.sequences, completion_logps(model, stale.sequences))
    sampler.reset_prefix_cache()
    fresh = sampler.sample(long_prompt, PARAMS, use_base_model=True)
    fresh_gap = logprob_gap(fresh.sequences, completion_logps(model, fresh.sequences))
    print(f"after a reload: max |dlogp| {stale_gap:.2e} with the old prefix cache, {fresh_gap:.2e} once reset")
    assert stale_gap > 1e-3 and fresh_gap <= ATOL


def test_sleep_and_wake_up_keep_the_weights(sampler, vllm_trainer, vllm_prompts, completion_logps, logprob_gap):
    """Between rounds an engine may sleep (on a GPU vLLM frees its memory); woken, it samples the same model."""
    model = vllm_trainer()
    sampler.load_base_weights(model.model.state_dict())
    sampler.sleep()
    sampler.wake_up()
    response = sampler.sample(vllm_prompts[:2], PARAMS, use_base_model=True)
    assert logprob_gap(response.sequences, completion_logps(model, response.sequences)) <= ATOL
