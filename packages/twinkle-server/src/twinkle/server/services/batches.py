"""What the scheduler runs for many tenants at once: training requests in one shared pass, sample calls in one batch.

A training request (:data:`twinkle.model.PassRequest`) joins other runs' requests in one forward and
backward (``ModelPool.forward_backward_many``); a :class:`SampleRequest` joins other sample calls in one
generation of the shared base's sampler (``ModelPool.sample_many``: one prefill, one decode loop), each
call with its own adapter, parameters and seed. A batch holds requests of one kind (:func:`batch_kind`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from twinkle.data_format import SamplingParams
from twinkle.model import PassRequest
from twinkle.server.services.scheduler import TRAINING

SAMPLE = "sample"


@dataclass(frozen=True)
class SampleRequest:
    """A sample call (``Sampler.sample``'s ``inputs``, ``params``, ``num_samples``) and the weights it samples with:

    - ``run_id``: the run's current weights, synced into its sampler first (native calls on a run);
    - ``base_path``: a full-model checkpoint's weights (their own sampler);
    - otherwise the shared base's sampler with its adapter ``adapter_name`` as it is there (``None``: the base
      model), first (re)loaded from a saved adapter's ``checkpoint`` directory when one is given (with
      ``keep_loaded``, only if the sampler does not serve ``adapter_name`` yet).

    ``template`` is the spec of the template that encodes trajectories and decodes text (``{}``: the default);
    ``None`` keeps the sampler's (token-id prompts: the Tinker and OpenAI APIs).
    """

    inputs: Any  # prompt features or trajectories
    params: SamplingParams | None
    adapter_name: str | None = None
    checkpoint: str | None = None
    keep_loaded: bool = False
    run_id: str | None = None
    base_path: str | None = None
    num_samples: int | None = None
    template: Mapping[str, Any] | None = None


SharedRequest = PassRequest | SampleRequest


def sample_slots(prompt_tokens: int, prompts: int, max_tokens: int, samples: int) -> int:
    """What a sample call's rows hold at most, in tokens: every sample's prompt and completion (its budget share)."""
    return (prompt_tokens + prompts * max_tokens) * samples


def batch_kind(request: Any) -> str:
    """The batch a request can join: :data:`SAMPLE` for a :class:`SampleRequest`, else a training pass."""
    return SAMPLE if isinstance(request, SampleRequest) else TRAINING
