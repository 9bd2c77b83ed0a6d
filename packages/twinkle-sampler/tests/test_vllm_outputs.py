"""How vLLM's outputs map onto Twinkle's (runs without vLLM: the outputs are plain objects here)."""

from types import SimpleNamespace

from twinkle.sampler import vllm_outputs


def _logprob(value, rank):
    return SimpleNamespace(logprob=value, rank=rank)


def test_completion_outputs_keep_sampled_logprobs_and_rank_ordered_alternatives():
    sample = SimpleNamespace(
        token_ids=[5, 9],
        finish_reason="stop",
        # vLLM adds the sampled token to the top-k when it falls outside (9 has rank 3 here)
        logprobs=[
            {5: _logprob(-0.1, 1), 7: _logprob(-2.0, 2)},
            {3: _logprob(-0.5, 1), 9: _logprob(-1.5, 3), 4: _logprob(-0.9, 2)},
        ],
    )
    completion = vllm_outputs.completion(sample, with_logprobs=True, k=2)
    assert completion.tokens == [5, 9] and completion.stop_reason == "stop"
    assert completion.logprobs == [-0.1, -1.5]
    assert completion.topk_logprobs == [[(5, -0.1), (7, -2.0)], [(3, -0.5), (4, -0.9)]]

    aborted = vllm_outputs.completion(SimpleNamespace(token_ids=[1], finish_reason="abort", logprobs=None), False, 0)
    assert aborted.stop_reason == "abort" and aborted.logprobs is None and aborted.topk_logprobs is None


def test_prompt_logprobs_start_with_none_and_follow_the_prompt_tokens():
    positions = [None, {2: _logprob(-1.0, 1)}, {3: _logprob(-2.0, 2), 8: _logprob(-0.5, 1)}]
    logprobs, alternatives = vllm_outputs.prompt_logprobs([1, 2, 3], positions, k=1)
    assert logprobs == [None, -1.0, -2.0]
    assert alternatives == [None, [(2, -1.0)], [(8, -0.5)]]
