"""vLLMSampler on a GPU: same results as TorchSampler for the same tokens, adapters through LoRARequests."""

import pytest
import torch

from twinkle.data_format import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a CUDA device"),
]
vllm = pytest.importorskip("vllm")

GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=True)


@pytest.fixture(scope="module")
def vllm_sampler(template):
    from twinkle.sampler import vLLMSampler

    sampler = vLLMSampler(
        engine_args={
            "dtype": "float32",
            "enable_lora": True,
            "max_lora_rank": 16,
            "gpu_memory_utilization": 0.3,
            "max_model_len": 1024,
            "enforce_eager": True,
        }
    )
    sampler.set_template(template)
    return sampler


def _close(ours, theirs, atol):
    return all(abs(a - b) <= atol for a, b in zip(ours, theirs, strict=True))


def test_greedy_tokens_and_logprobs_match_torch_sampler(vllm_sampler, shared_sampler, prompts):
    theirs = vllm_sampler.sample(prompts[:3], GREEDY)
    ours = shared_sampler.sample(prompts[:3], GREEDY)
    for a, b in zip(theirs.sequences, ours.sequences, strict=True):
        assert a.tokens == b.tokens and a.decoded == b.decoded
        assert _close(a.logprobs, b.logprobs, 1e-3)
        assert [t for t, _ in a.topk_logprobs[0]] == [t for t, _ in b.topk_logprobs[0]]
        assert a.new_input_feature["labels"] == b.new_input_feature["labels"]
    assert _close(theirs.prompt_logprobs[0][1:], ours.prompt_logprobs[0][1:], 1e-3)


def test_adapters_from_tensors_and_directories(vllm_sampler, sampler, prompts, trained_model, lora_of, tmp_path):
    model = trained_model("tenant")
    config, state_dict = lora_of(model, "tenant")
    vllm_sampler.add_adapter("tenant", config, state_dict)
    sampler.add_adapter("tenant", config, state_dict)
    rows = ["tenant", None, "tenant"]
    theirs = vllm_sampler.sample(prompts[:3], GREEDY, adapter_name=rows)
    ours = sampler.sample(prompts[:3], GREEDY, adapter_name=rows)
    for a, b in zip(theirs.sequences, ours.sequences, strict=True):
        assert a.tokens == b.tokens and _close(a.logprobs, b.logprobs, 1e-3)
    path = model.save("ckpt", output_dir=tmp_path, save_optimizer=False)
    vllm_sampler.load_adapter("tenant", path)  # replaces the version added from tensors
    again = vllm_sampler.sample(prompts[:1], GREEDY, adapter_name="tenant")
    assert again.sequences[0].tokens == theirs.sequences[0].tokens
    vllm_sampler.remove_adapter("tenant")
    assert vllm_sampler.adapter_names == []


def test_seeded_sampling_is_repeatable_and_honours_num_samples(vllm_sampler, prompts):
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3, num_samples=3)
    first, again = vllm_sampler.sample(prompts[:2], params), vllm_sampler.sample(prompts[:2], params)
    assert len(first.sequences) == 6
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
