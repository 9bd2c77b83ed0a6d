"""``TorchSampler`` over HTTP: completions from the server's sampler, with a run's live LoRA adapter.

The server samples the same base model it trains, so ``adapter_name`` (an
adapter added with ``model.add_adapter_to_model``) always means that adapter's
current weights; see :mod:`twinkle_client.checkpoint_engine`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from twinkle.data_format import InputFeature, SampleResponse, SamplingParams, Trajectory
from twinkle.errors import InvalidInputError
from twinkle.utils import get_logger
from twinkle_client.components import merged_spec
from twinkle_client.context import CHECKPOINT_SCHEME, check_base_model, get_client
from twinkle_client.http import TwinkleClient

if TYPE_CHECKING:
    from twinkle_client.model import TransformersModel

logger = get_logger(__name__)


class TorchSampler:
    """Remote twin of ``twinkle.sampler.TorchSampler``; local options (device, vLLM engine args) are ignored."""

    def __init__(self, model_id: str | None = None, **ignored_local_options: Any) -> None:
        self._client = get_client()
        self.model_id = check_base_model(self._client, model_id, type(self).__name__)
        self._template: dict[str, Any] | None = None
        self._model: TransformersModel | None = None
        self._default_run: str | None = None
        if ignored_local_options:
            logger.info("server-side options ignored by the remote sampler: %s", sorted(ignored_local_options))

    def set_template(self, template: Any, **kwargs: Any) -> None:
        """The template the server encodes trajectory inputs and decodes completions with (sent with each sample)."""
        name, built = merged_spec(template, kwargs, "set_template(template)")
        self._template = {"name": name, "kwargs": built}

    def use_model(self, model: TransformersModel, default_run: str | None = None) -> None:
        """Resolve ``adapter_name`` through ``model``; ``default_run`` serves ``adapter_name=None`` (a merged sync)."""
        self._model = model
        self._default_run = default_run

    def sample(
        self,
        inputs: InputFeature | Trajectory | Sequence[InputFeature | Trajectory],
        sampling_params: SamplingParams | None = None,
        adapter_name: str | None = None,
        num_samples: int | None = None,
    ) -> SampleResponse:
        """``num_samples`` completions per input (default ``sampling_params.num_samples``), prompt-major."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        prompts = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        run_id = self._run_for(adapter_name)
        base_model = self.model_id if run_id is None and self.model_id.startswith(CHECKPOINT_SCHEME) else None
        return sample_request(self._client, prompts, params, run_id, num_samples, self._template, base_model)

    def _run_for(self, adapter_name: Any) -> str | None:
        if adapter_name is None:
            return self._default_run
        if not isinstance(adapter_name, str):
            raise InvalidInputError(
                f"a remote sampler takes one adapter_name per call, got {adapter_name!r}; "
                "split the inputs by adapter and call sample once per adapter"
            )
        if self._model is not None and adapter_name in self._model.adapter_names:
            return self._model.run_id(adapter_name)
        run_id = self._client.adapter_runs.get(adapter_name)
        if run_id is None:
            raise InvalidInputError(
                f"unknown adapter {adapter_name!r}; adapters: {sorted(self._client.adapter_runs)}. "
                "Add it with model.add_adapter_to_model(...)"
            )
        return run_id


vLLMSampler = TorchSampler  # the in-process name; the server decides the back-end


def sample_request(
    client: TwinkleClient,
    inputs: list[Any],
    params: SamplingParams,
    run_id: str | None,
    num_samples: int | None = None,
    template: dict[str, Any] | None = None,
    base_model: str | None = None,
) -> SampleResponse:
    """``POST /sample`` and wait for the completions (``base_model``: a checkpoint to sample without a run)."""
    body: dict[str, Any] = {
        "inputs": inputs,
        "sampling_params": params.to_dict(),
        "num_samples": params.num_samples if num_samples is None else num_samples,
    }
    if run_id is not None:
        body["run_id"] = run_id
    if template is not None:
        body["template"] = template
    if base_model is not None:
        body["base_model"] = base_model
    result = client.resolve(client.request("POST", "/sample", body))
    return result if isinstance(result, SampleResponse) else SampleResponse.from_dict(result)
