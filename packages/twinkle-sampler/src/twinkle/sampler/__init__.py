"""Samplers: completions with raw log-probs and ready-to-train features, a LoRA adapter per prompt.

``TorchSampler`` runs in plain PyTorch anywhere the trainer runs; ``vLLMSampler``
(extra ``twinkle-sampler[vllm]``) serves the same interface from vLLM on GPUs.
"""

from twinkle.data_format import SampleCall, SampleResult  # sample_many's call and result, as the client has them
from twinkle.sampler.base import Sampler
from twinkle.sampler.torch_sampler import TorchSampler
from twinkle.sampler.vllm_sampler import vLLMSampler

__all__ = ["SampleCall", "SampleResult", "Sampler", "TorchSampler", "vLLMSampler"]
