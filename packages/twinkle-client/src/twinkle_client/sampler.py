"""``TorchSampler`` over HTTP: completions from the server's sampler, with a run's live LoRA adapter.

The server samples the same base model it trains, so ``adapter_name`` (an
adapter added with ``model.add_adapter_to_model``) always means that adapter's
current weights; see :mod:`twinkle_client.checkpoint_engine`. Which weights a
call samples follows the in-process rule: without ``adapter_name``, the one
adapter synced into this sampler (``sync_weights``), the base model when none
was, an error when several were; ``use_base_model=True`` asks for the base.
:meth:`TorchSampler.sample_many` sends several calls at once, which the server
generates together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from twinkle.data_format import InputFeature, SampleCall, SampleResponse, SampleResult, SamplingParams, Trajectory
from twinkle.errors import InvalidInputError
from twinkle.utils import get_logger
from twinkle_client.components import merged_spec
from twinkle_client.context import CHECKPOINT_SCHEME, check_base_model, get_client
from twinkle_client.http import TwinkleClient
from twinkle_client.images import images_by_value

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
        self._synced: dict[str, str] = {}  # adapter name -> run id, from LoRA syncs
        self._merged_run: str | None = None  # a merged sync made this run's weights the sampler's base
        if ignored_local_options:
            logger.info("server-side options ignored by the remote sampler: %s", sorted(ignored_local_options))

    def set_template(self, template: Any, **kwargs: Any) -> None:
        """The template the server encodes trajectory inputs and decodes completions with (sent with each sample)."""
        name, built = merged_spec(template, kwargs, "set_template(template)")
        self._template = {"name": name, "kwargs": built}

    @property
    def adapter_names(self) -> list[str]:
        """The adapters :meth:`sample` can name: those added to this client's models."""
        names = self._model.adapter_names if self._model is not None else []
        return list(dict.fromkeys([*names, *self._client.adapter_runs]))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text a user sees for ``token_ids`` (special tokens left out), decoded by the server's tokenizer."""
        body: dict[str, Any] = {"token_ids": [list(token_ids)], "skip_special_tokens": True}
        if self._template is not None:
            body["template"] = self._template
        return self._client.request("POST", "/templates/decode", body)["texts"][0]

    def reset_prefix_cache(self) -> None:
        """Nothing to clear from here: the server's sampler keeps no prompt cache between calls.

        It exists, as on the in-process ``TorchSampler``, so loops written for ``vLLMSampler`` run unchanged.
        """

    def use_model(self, model: TransformersModel, adapter_name: str | None, merged: bool = False) -> None:
        """Record a sync of ``model``'s adapter (``None``: its full-parameter run) and resolve names through it.

        A LoRA sync serves the adapter under its name (what a call without a name uses when it is the only
        one); a merged sync makes the run's weights what this sampler samples as its base model.
        """
        self._model = model
        run_id = model.run_id(adapter_name)
        if merged:
            self._merged_run = run_id
        else:
            assert adapter_name is not None, "a LoRA sync names its adapter"
            self._synced[adapter_name] = run_id

    def sample(
        self,
        inputs: InputFeature | Trajectory | Sequence[InputFeature | Trajectory],
        sampling_params: SamplingParams | None = None,
        adapter_name: str | None = None,
        num_samples: int | None = None,
        use_base_model: bool = False,
    ) -> SampleResponse:
        """``num_samples`` completions per input (default ``sampling_params.num_samples``), prompt-major.

        Adapters and order as in ``twinkle.sampler.Sampler.sample`` (see the module docstring).
        """
        call = SampleCall(inputs, sampling_params, adapter_name, num_samples, use_base_model)
        reply, adapter = self._send(call)
        return self._response(reply, adapter)

    def sample_many(self, calls: Sequence[SampleCall]) -> list[SampleResult]:
        """Several :meth:`sample` calls sent at once, so the server generates them together; each call gets its
        response or its error (one refused here or by the server does not stop the others)."""
        sent: list[tuple[SampleResult, Any, str | None]] = []
        results = [SampleResult() for _ in calls]
        for result, call in zip(results, calls, strict=True):
            try:
                sent.append((result, *self._send(call)))
            except Exception as exc:  # this call's problem only
                result.error = exc
        for result, reply, adapter in sent:
            try:
                result.output = self._response(reply, adapter)
            except Exception as exc:
                result.error = exc
        return results

    def _send(self, call: SampleCall) -> tuple[Any, str | None]:
        """``POST /sample`` for the call: the server's reply (its future) and the adapter that samples."""
        params = call.sampling_params if call.sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        inputs = call.inputs
        prompts = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        adapter = self._adapter_for(call.adapter_name, call.use_base_model)
        run_id = self._run_for(adapter) if adapter is not None else self._merged_run
        base_model = self.model_id if run_id is None and self.model_id.startswith(CHECKPOINT_SCHEME) else None
        body = sample_body(prompts, params, run_id, call.num_samples, self._template, base_model)
        return self._client.request("POST", "/sample", body), adapter

    def _response(self, reply: Any, adapter: str | None) -> SampleResponse:
        response = sample_response(self._client, reply)
        for sequence in response.sequences:  # the server knows the run; the user knows the adapter's name
            sequence.adapter_name = adapter
        return response

    def _adapter_for(self, adapter_name: Any, use_base_model: bool) -> str | None:
        """The adapter that samples (``None``: the base model), by the in-process rule."""
        if not isinstance(use_base_model, bool):
            raise InvalidInputError(f"use_base_model must be True or False, got {use_base_model!r}")
        if use_base_model:
            if adapter_name is not None:
                raise InvalidInputError(
                    f"use_base_model=True samples without any adapter: do not also pass adapter_name={adapter_name!r}"
                )
            return None
        if adapter_name is None:
            if len(self._synced) > 1:
                raise InvalidInputError(
                    f"this sampler serves several adapters {sorted(self._synced)}: pass adapter_name=<one of them>, "
                    "or use_base_model=True for the base model"
                )
            return next(iter(self._synced), None)
        if not isinstance(adapter_name, str):
            raise InvalidInputError(
                f"a remote sampler takes one adapter_name per call, got {adapter_name!r}; "
                "split the inputs by adapter and call sample once per adapter"
            )
        return adapter_name

    def _run_for(self, adapter_name: str) -> str:
        """The server run behind ``adapter_name``: the one synced under that name, else the client's."""
        if adapter_name in self._synced:
            return self._synced[adapter_name]
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


def sample_request(client: TwinkleClient, body: dict[str, Any]) -> SampleResponse:
    """``POST /sample`` (a :func:`sample_body`) and wait for the completions."""
    return sample_response(client, client.request("POST", "/sample", body))


def sample_body(
    inputs: list[Any],
    params: SamplingParams,
    run_id: str | None,
    num_samples: int | None = None,
    template: dict[str, Any] | None = None,
    base_model: str | None = None,
) -> dict[str, Any]:
    """The body of ``POST /sample`` (``base_model``: a checkpoint to sample without a run)."""
    body: dict[str, Any] = {
        "inputs": images_by_value(inputs),  # a trajectory's images as data URIs
        "sampling_params": params.to_dict(),
        "num_samples": params.num_samples if num_samples is None else num_samples,
    }
    if run_id is not None:
        body["run_id"] = run_id
    if template is not None:
        body["template"] = template
    if base_model is not None:
        body["base_model"] = base_model
    return body


def sample_response(client: TwinkleClient, reply: Any) -> SampleResponse:
    """The completions of a ``POST /sample`` reply (its future waited for)."""
    result = client.resolve(reply)
    return result if isinstance(result, SampleResponse) else SampleResponse.from_dict(result)
