"""vLLMSampler's start-up self-test: does a base row that shares a batch with adapters get one of them?

vLLM's CPU LoRA kernels index the adapter slots with the row's slot number, ``-1`` for rows without an
adapter, and ``-1`` picks the *last* slot: a base row then gets whatever adapter that slot holds (vLLM
0.32). The test runs a base row alone, then in a batch that fills every slot with a random probe adapter
(random rank-1 updates of one layer, removed afterwards); if the row changes, the sampler sends every base
row through an all-zero adapter instead, which computes the base model exactly. The test, not the device
name, decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from twinkle.errors import ConfigurationError

# A base row whose log-probs move by more than this when probe adapters share its batch has been given one.
SELF_TEST_ATOL = 1e-4

Request = Callable[[str, Any, Mapping[str, torch.Tensor]], Any]  # (name, config, tensors) -> a LoRARequest


def probe_adapter(
    layers: Mapping[str, tuple[int, int]], seed: int | None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A rank-1 adapter on the model's first linear layer (of ``layers``: name -> (fan_in, fan_out)): random
    (``seed``) or all zeros (``None``)."""
    module, (fan_in, fan_out) = next(iter(layers.items()))
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": [module.rsplit(".", 1)[-1]]}
    shapes = {"A": (1, fan_in), "B": (fan_out, 1)}
    if seed is None:
        tensors = {part: torch.zeros(shape) for part, shape in shapes.items()}
    else:
        generator = torch.Generator().manual_seed(seed)
        tensors = {part: torch.randn(shape, generator=generator) for part, shape in shapes.items()}
    return config, {f"base_model.model.{module}.lora_{part}.weight": value for part, value in tensors.items()}


def base_rows_get_adapters(
    llm: Any, layers: Mapping[str, tuple[int, int]], slots: int, request: Request, unload: Callable[[Any], None]
) -> bool:
    """Run the self-test on a fresh engine (every one of its ``slots`` empty), before any adapter is served."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(range(1, 9)))
    params = VllmSamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    probes = [request("probe", *probe_adapter(layers, seed)) for seed in range(slots)]
    try:
        outputs = llm.generate([prompt] * (len(probes) + 1), params, lora_request=[None, *probes], use_tqdm=False)
    finally:
        for probe in probes:
            unload(probe)
    rows = [output.outputs[0] for output in outputs]
    if not any(_differ(alone, probe) for probe in rows[1:]):
        raise ConfigurationError(
            "vLLMSampler's self-test is inconclusive: its probe adapters did not change the output, so it "
            "cannot tell whether base rows are mixed with adapters; pass zero_adapter_for_base=True or False"
        )
    return _differ(alone, rows[0])


def _differ(first: Any, second: Any) -> bool:
    """Two vLLM completions differ in tokens or in a sampled token's log-prob by more than ``SELF_TEST_ATOL``."""
    if list(first.token_ids) != list(second.token_ids):
        return True
    pairs = zip(first.token_ids, first.logprobs, second.logprobs, strict=True)
    return any(abs(a[token].logprob - b[token].logprob) > SELF_TEST_ATOL for token, a, b in pairs)
