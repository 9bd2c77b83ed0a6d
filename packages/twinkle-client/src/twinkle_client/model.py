"""``TransformersModel`` over HTTP: the in-process training API, run by a Twinkle server.

Each LoRA adapter added here is a *run* on the server (an adapter in its shared
multi-LoRA pool, trained together with other tenants'). ``adapter_name`` is a
local name mapped to the run id; with one adapter it may be omitted, as
in-process. As in-process, a model without adapters trains all weights: its
calls go to a full-parameter run, created on first use, which has its own copy of
the model on the server (if the server allows such runs). ``model_id`` may be a
``twinkle://`` full-model checkpoint that ``save`` returned: the runs then start
from it. The constructor's local options (device mesh, dtype, ...) belong to the
server, so they are ignored here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twinkle.data_format import LossOutput, ModelOutput, SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.infra import get_runtime
from twinkle.interfaces import Metric
from twinkle.registry import build
from twinkle.utils import get_logger
from twinkle_client.components import merged_spec
from twinkle_client.context import CHECKPOINT_SCHEME, check_base_model, get_client
from twinkle_client.images import images_by_value
from twinkle_client.lora import LoraConfig, lora_config_dict
from twinkle_client.sampler import sample_body, sample_request

logger = get_logger(__name__)


class TransformersModel:
    """Remote twin of ``twinkle.model.TransformersModel``; see the module docstring.

    ``model_id``, when given, must be the server's base model or a ``twinkle://`` checkpoint.
    """

    def __init__(self, model_id: str | None = None, **ignored_local_options: Any) -> None:
        self._client = get_client()
        self.model_id = check_base_model(self._client, model_id, type(self).__name__)
        self._checkpoint = self.model_id if self.model_id.startswith(CHECKPOINT_SCHEME) else None
        self._runs: dict[str, str] = {}
        self._full_run: str | None = None
        self._metrics: dict[str, list[Metric]] = {}  # run id -> metrics added here, reported by calculate_metric
        if ignored_local_options:
            logger.info("server-side options ignored by the remote model: %s", sorted(ignored_local_options))

    # ------------------------------------------------------------------ adapters

    @property
    def adapter_names(self) -> list[str]:
        return list(self._runs)

    def run_id(self, adapter_name: str | None = None) -> str:
        """The server run behind ``adapter_name``: the only adapter when omitted, or without adapters the
        full-parameter run (created here on first use)."""
        if adapter_name is not None:
            if adapter_name not in self._runs:
                raise ConfigurationError(f"unknown adapter {adapter_name!r}; adapters: {self.adapter_names}")
            return self._runs[adapter_name]
        if len(self._runs) > 1:
            raise ConfigurationError(f"this model has several adapters {self.adapter_names}: pass adapter_name=")
        if self._runs:
            return next(iter(self._runs.values()))
        if self._full_run is None:
            self._full_run = self._client.create_run(None, base_model=self._checkpoint)
        return self._full_run

    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: LoraConfig | dict[str, Any],
        gradient_accumulation_steps: int = 1,
        seed: int | None = None,
    ) -> None:
        """Create a run with this LoRA adapter on the server.

        ``config_or_dir`` is a :class:`LoraConfig` or a dict of its arguments; a saved adapter is
        loaded afterwards with :meth:`load` (the server cannot read a local directory). ``seed``
        (default: the seed given to ``twinkle.initialize``) fixes the adapter's initial weights, so a
        remote run starts the same way every time whatever else the server is doing.
        """
        if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
            raise ConfigurationError(f"adapter_name must be a non-empty string without dots, got {adapter_name!r}")
        if adapter_name in self._runs:
            raise ConfigurationError(f"adapter {adapter_name!r} already exists; pick another name")
        if self._full_run is not None:
            raise ConfigurationError(
                "this model is set up for full-parameter training (a call was made without adapters); "
                "add adapters before anything else"
            )
        seed = get_runtime().seed if seed is None else seed
        run_id = self._client.create_run(
            lora_config_dict(config_or_dir), gradient_accumulation_steps, self._checkpoint, seed=seed
        )
        self._runs[adapter_name] = run_id
        self._client.adapter_runs[adapter_name] = run_id

    # ------------------------------------------------------------------ components

    def set_optimizer(self, optimizer_cls: Any = "AdamW", adapter_name: str | None = None, **kwargs: Any) -> None:
        self._set("set_optimizer", "optimizer_cls", optimizer_cls, adapter_name, kwargs)

    def set_lr_scheduler(self, scheduler_cls: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._set("set_lr_scheduler", "scheduler_cls", scheduler_cls, adapter_name, kwargs)

    def set_loss(self, loss: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._set("set_loss", "loss", loss, adapter_name, kwargs)

    def set_processor(self, processor: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._set("set_processor", "processor", processor, adapter_name, kwargs)

    def set_template(self, template: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._set("set_template", "template", template, adapter_name, kwargs)

    def add_metric(self, metric: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Also report ``metric`` from :meth:`calculate_metric` (then reset it), as in-process.

        The metric lives here, like rewards and advantages: feed it with its own ``accumulate`` calls.
        """
        built = build("metric", metric, **kwargs)
        self._metrics.setdefault(self.run_id(adapter_name), []).append(built)

    # ------------------------------------------------------------------ steps

    def forward(self, inputs: Any, adapter_name: str | None = None) -> ModelOutput:
        return _model_output(self._call("forward", adapter_name, inputs=inputs))

    def calculate_loss(self, adapter_name: str | None = None, **loss_inputs: Any) -> LossOutput:
        result = self._call("calculate_loss", adapter_name, **loss_inputs)
        return result if isinstance(result, LossOutput) else LossOutput.from_dict(result)

    def backward(self, adapter_name: str | None = None) -> None:
        self._call("backward", adapter_name)

    def forward_backward(
        self, inputs: Any, micro_batch_size: int | None = None, adapter_name: str | None = None, **loss_inputs: Any
    ) -> ModelOutput:
        result = self._call(
            "forward_backward", adapter_name, inputs=inputs, micro_batch_size=micro_batch_size, **loss_inputs
        )
        return _model_output(result)

    def forward_only(
        self, inputs: Any, adapter_name: str | None = None, return_logits: bool = False, **loss_inputs: Any
    ) -> ModelOutput:
        result = self._call("forward_only", adapter_name, inputs=inputs, return_logits=return_logits, **loss_inputs)
        return _model_output(result)

    def clip_grad_norm(self, max_grad_norm: float = 1.0, adapter_name: str | None = None) -> float:
        return self._call("clip_grad_norm", adapter_name, max_grad_norm=max_grad_norm)

    def step(self, adapter_name: str | None = None) -> None:
        self._call("step", adapter_name)

    def zero_grad(self, adapter_name: str | None = None) -> None:
        self._call("zero_grad", adapter_name)

    def lr_step(self, adapter_name: str | None = None) -> None:
        self._call("lr_step", adapter_name)

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, adapter_name: str | None = None) -> dict[str, Any]:
        return self._call("clip_grad_and_step", adapter_name, max_grad_norm=max_grad_norm)

    def update_optimizer(self, adapter_name: str | None = None, **hyperparameters: Any) -> None:
        """Set hyper-parameters (``lr``, ``betas``, ...) of the run's optimizer in place, keeping its state."""
        self._call("update_optimizer", adapter_name, **hyperparameters)

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        result = dict(self._call("calculate_metric", adapter_name, is_training=is_training))
        for metric in self._metrics.get(self.run_id(adapter_name), []):
            result.update(metric.calculate())
            metric.reset()
        return result

    def generate(self, input_ids: list[int], max_new_tokens: int = 64, adapter_name: str | None = None) -> list[int]:
        """Greedy continuation of one prompt with this adapter: the server's sampler at temperature 0."""
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, logprobs=False)
        body = sample_body([{"input_ids": list(input_ids)}], params, self.run_id(adapter_name))
        response = sample_request(self._client, body)
        return list(response.sequences[0].tokens)

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        name: str,
        output_dir: str | None = None,
        save_optimizer: bool = True,
        adapter_name: str | None = None,
        dataloader: Any = None,
        *,
        ttl_seconds: float | None = None,
    ) -> str:
        """Save a checkpoint in the server's checkpoint store; returns its server path (pass it to ``load``).

        ``output_dir`` is a local option: remote checkpoints live where the server keeps them. With
        ``ttl_seconds`` the server deletes the checkpoint that long after saving it (listed with its
        ``expires_at`` until then); by default it is kept until deleted.
        """
        if dataloader is not None:
            raise ConfigurationError("a remote save cannot record a dataloader position; call save without it")
        expiry = {} if ttl_seconds is None else {"ttl_seconds": ttl_seconds}
        return self._call("save", adapter_name, name=name, save_optimizer=save_optimizer, **expiry)

    def load(self, path: str, adapter_name: str | None = None, load_optimizer: bool = False) -> None:
        """Load a checkpoint saved by :meth:`save` (its returned path) into the adapter."""
        self._call("load", adapter_name, path=path, load_optimizer=load_optimizer)

    def list_checkpoints(self, adapter_name: str | None = None) -> list[dict[str, Any]]:
        """``[{"name", "path", "created_at", "expires_at"}, ...]`` of this adapter's run (``expires_at``: None
        for a checkpoint kept until deleted)."""
        return self._client.list_checkpoints(self.run_id(adapter_name))

    def delete_checkpoint(self, name: str, adapter_name: str | None = None) -> None:
        self._client.delete_checkpoint(self.run_id(adapter_name), name)

    def set_checkpoint_ttl(self, name: str, ttl_seconds: float | None, adapter_name: str | None = None) -> None:
        """Have the server delete checkpoint ``name`` ``ttl_seconds`` from now, or keep it until deleted (None)."""
        self._client.set_checkpoint_ttl(self.run_id(adapter_name), name, ttl_seconds)

    # ------------------------------------------------------------------ internals

    def _call(self, method: str, adapter_name: str | None, **kwargs: Any) -> Any:
        if "inputs" in kwargs:  # trajectories' images travel by value
            kwargs["inputs"] = images_by_value(kwargs["inputs"])
        return self._client.call(self.run_id(adapter_name), method, **kwargs)

    def _set(
        self, method: str, argument: str, component: Any, adapter_name: str | None, kwargs: dict[str, Any]
    ) -> None:
        name, built = merged_spec(component, kwargs, f"{method}({argument})")
        self._call(method, adapter_name, **{argument: name}, **built)


MultiLoraModel = TransformersModel  # remotely every model is the server's multi-LoRA model


def _model_output(result: Any) -> ModelOutput:
    """A ``ModelOutput`` (or its dict) with ``logps``/``logits`` as float32 numpy arrays (one per sample in a list)."""
    output = result if isinstance(result, ModelOutput) else ModelOutput.from_dict(result)
    output.logps, output.logits = _float_arrays(output.logps), _float_arrays(output.logits)
    return output


def _float_arrays(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [np.asarray(item, dtype=np.float32) for item in value]
    return np.asarray(value, dtype=np.float32)
