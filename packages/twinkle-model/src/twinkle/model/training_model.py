"""``TrainingModel``: the semantic training API over a Hugging Face causal LM, for any adapter back-end.

Every public method is usable on its own, so a training loop reads like plain PyTorch (``forward`` →
``calculate_loss`` → ``backward`` → ``step``) or uses the fused calls (``forward_backward``, ``clip_grad_and_step``).
Each LoRA adapter — or the full model when there is none — owns its optimizer, LR scheduler, loss, processor,
template, metrics and counters (:class:`TrainState`).

Subclasses decide how adapters live in the model: :class:`TransformersModel` through PEFT, :class:`MultiLoraModel`
as per-row multi-adapter layers. They implement the five hooks ``_add_adapter``, ``_route_rows``,
``adapter_state_dict``, ``write_adapter_files`` and ``load_adapter_weights``.

Under ``torchrun`` the ``device_mesh`` (or ``twinkle.initialize``'s ``global_device_mesh``) makes the same code
train with DDP (``dp_size``) or FSDP2 (``fsdp_size``), each rank on its share of the global batch: see
:mod:`twinkle.model.parallel`. Every forward, loss and backward of a call runs through the one pass engine,
:class:`twinkle.model.passes.engine.PassEngine`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
from peft import PeftConfig

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.infra import DeviceMesh, get_runtime
from twinkle.kernel import rekernelize
from twinkle.model import peft_adapters, stepwise
from twinkle.model.checkpoints import save_load
from twinkle.model.features import BatchPreparer
from twinkle.model.loading import CheckpointingPolicy, load_causal_lm
from twinkle.model.optimizer_calls import OptimizerCalls
from twinkle.model.parallel import Parallelism, local_device, parallelism_for
from twinkle.model.passes.engine import PassEngine
from twinkle.model.passes.logps import inner_model
from twinkle.model.passes.plans import LossPlan, Plan, TargetsPlan
from twinkle.model.passes.requests import AdapterResult, LossFn, TargetSequence, TargetsOutput, model_limits
from twinkle.model.precision import MixedPrecision, check_mixed_precision
from twinkle.model.seeding import seeded
from twinkle.model.train_state import FULL_MODEL, TrainState, check_new_adapter, find_state, new_state
from twinkle.module import build_optimizer
from twinkle.patch import KernelsSpec, PatchSpec
from twinkle.registry import build
from twinkle.utils import get_logger

logger = get_logger(__name__)
OutputT = TypeVar("OutputT", ModelOutput, TargetsOutput)


class TrainingModel(OptimizerCalls, ABC):
    """A transformers causal LM trained through semantic calls; see the module docstring.

    ``model_id`` is anything :func:`twinkle.hub.resolve_model` accepts (default:
    the embedded ``builtin://qwen3-tiny``). Weights stay in ``dtype`` (float32 by
    default); ``mixed_precision`` runs the forward under autocast. ``device``
    defaults to CUDA (``cuda:LOCAL_RANK`` under torchrun) when there is one.
    ``kernels`` (``True``: the family's defaults, or a mapping) and ``patches``
    go into the model through :func:`twinkle.patch.accelerate`;
    ``gradient_checkpointing`` (``True`` or every n-th layer) recomputes the
    decoder layers' activations in backward instead of keeping them.
    """

    trains_full_model = True  # without adapters, every weight trains
    supports_data_parallel = True  # DDP / FSDP2 over a device_mesh under torchrun
    one_worker_per_rank = True  # on Ray: an actor per rank of its mesh, each joining its process group

    def __init__(
        self,
        model_id: str | None = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: MixedPrecision = "no",
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        logps_chunk_size: int = 4096,
        kernels: KernelsSpec = False,
        patches: Sequence[PatchSpec] = (),
        gradient_checkpointing: CheckpointingPolicy = False,
        **from_pretrained_kwargs: Any,
    ) -> None:
        check_mixed_precision(mixed_precision)
        self.model_path = resolve_model(model_id)
        self.device_mesh = device_mesh or get_runtime().global_device_mesh
        self.device = local_device(device)
        self.parallel = self._parallelism()
        self.mixed_precision = mixed_precision
        self.logps_chunk_size = logps_chunk_size
        # A transformers PreTrainedModel, typed Any (a PeftModel around it once adapters are added).
        options = {"dtype": dtype, "attn_implementation": attn_implementation, **from_pretrained_kwargs}
        self.model = self._load_model(gradient_checkpointing, kernels, patches, options)
        self.parallel.prepare(self.model)
        config = self.model.config.get_text_config()  # a vision-language model's language model config
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        pad_token_id = getattr(config, "pad_token_id", None)
        self.pad_token_id = pad_token_id if pad_token_id is not None else 0
        self._states: dict[str, TrainState] = {}
        self._batches = BatchPreparer(self.vocab_size)
        self._engine = PassEngine(self, self._route_rows)

    # ------------------------------------------------------------------ adapters and components

    @property
    def adapter_names(self) -> list[str]:
        return [name for name in self._states if name != FULL_MODEL]

    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: PeftConfig | Mapping[str, Any] | str | Path,
        gradient_accumulation_steps: int = 1,
        seed: int | None = None,
    ) -> None:
        """Add a LoRA adapter (a ``LoraConfig``, a dict of its arguments, or a saved adapter directory).

        ``seed`` makes the adapter's random initialisation independent of everything else drawn from
        torch's RNG (the global RNG is left as it was).
        """
        self.parallel.check_unwrapped("adding an adapter")
        check_new_adapter(self._states, adapter_name, gradient_accumulation_steps)
        directory = None
        if isinstance(config_or_dir, (str, Path)):
            directory = Path(config_or_dir)
            config = peft_adapters.read_adapter_config(directory)
        else:
            config = peft_adapters.as_peft_config(config_or_dir)
        with seeded(seed):
            params = self._add_adapter(adapter_name, config, directory)
        rekernelize(inner_model(self.model))  # the adapter's new layers get kernels too
        self._states[adapter_name] = new_state(adapter_name, params, gradient_accumulation_steps, self.pad_token_id)

    @abstractmethod
    def _add_adapter(self, adapter_name: str, config: PeftConfig, directory: Path | None) -> list[torch.nn.Parameter]:
        """Create the adapter (weights from ``directory`` when given) and return its trainable parameters."""

    def set_optimizer(self, optimizer_cls: Any = "AdamW", adapter_name: str | None = None, **kwargs: Any) -> None:
        """Create the optimizer (a ``torch.optim`` name or class, or ``'default'``) over this adapter's weights."""
        state = self.train_state(adapter_name)
        self.parallel.wrap(self.model, self._states.values())  # the optimizer must hold the final (sharded) params
        state.optimizer = build_optimizer(optimizer_cls, state.params, **kwargs)
        state.lr_scheduler = None  # a scheduler is bound to the optimizer it was built for

    def set_lr_scheduler(self, scheduler_cls: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Create an LR scheduler (registered name or class) for this adapter's optimizer."""
        if isinstance(scheduler_cls, torch.optim.lr_scheduler.LRScheduler):
            raise ConfigurationError(
                "pass an LR scheduler class or name, not an instance: it must be built on this adapter's optimizer"
            )
        state = self.train_state(adapter_name)
        state.lr_scheduler = build("lr_scheduler", scheduler_cls, optimizer=state.require_optimizer(), **kwargs)

    def set_loss(self, loss: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Use ``loss`` (instance, class or registered name such as ``'CrossEntropyLoss'``)."""
        self._configured(adapter_name).loss = build("loss", loss, **kwargs)

    def set_processor(self, processor: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Use ``processor`` to collate features; its pad id is set to the model's."""
        processor = build("processor", processor, **kwargs)
        if hasattr(processor, "pad_token_id"):
            processor.pad_token_id = self.pad_token_id
        self._configured(adapter_name).processor = processor

    def set_template(self, template: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Use ``template`` to encode trajectories passed as inputs (``model_id`` defaults to this model's)."""
        if isinstance(template, (str, type)):
            kwargs.setdefault("model_id", self.model_path)
        self._configured(adapter_name).template = build("template", template, **kwargs)

    def add_metric(self, metric: Any, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Also report ``metric`` (a ``twinkle.interfaces.Metric``) from ``calculate_metric``."""
        metric = build("metric", metric, **kwargs)
        self._configured(adapter_name).metrics.append(metric)

    # ------------------------------------------------------------------ steps

    def forward(self, inputs: Any, adapter_name: str | None = None) -> ModelOutput:
        """Forward with autograd; ``calculate_loss`` and ``backward`` continue from it."""
        return stepwise.forward(self._step_host(), self.train_state(adapter_name), inputs)

    def calculate_loss(self, adapter_name: str | None = None, **loss_inputs: Any) -> LossOutput:
        """The loss of the last ``forward`` (kept for ``backward``)."""
        return stepwise.calculate_loss(self._step_host(), self.train_state(adapter_name), loss_inputs)

    def backward(self, adapter_name: str | None = None) -> None:
        """Back-propagate the loss from ``calculate_loss`` (scaled by 1/gradient_accumulation_steps)."""
        stepwise.backward(self._step_host(), self.train_state(adapter_name))

    def forward_backward(
        self,
        inputs: Any,
        micro_batch_size: int | None = None,
        adapter_name: str | None = None,
        **loss_inputs: Any,
    ) -> ModelOutput:
        """Forward, loss and backward over ``inputs`` in micro-batches, accumulating gradients.

        The whole batch is validated first and the loss is normalised over the
        whole batch, so the gradients equal one big-batch step; on any error the
        gradients are left exactly as they were before the call.
        """
        return self._run_loss_plan(adapter_name, inputs, loss_inputs, True, micro_batch_size)

    def forward_only(
        self, inputs: Any, adapter_name: str | None = None, return_logits: bool = False, **loss_inputs: Any
    ) -> ModelOutput:
        """Forward without gradients (eval mode): per-sample ``logps``, and the loss when it can be computed.

        The loss is computed when labels exist and every input the loss requires
        (``Loss.required_inputs``, e.g. ``advantages``) is given, so reading
        log-probabilities never needs loss inputs. ``return_logits`` also returns
        each sample's ``[T, V]`` float32 logits (large: use for checks).
        """
        return self._run_loss_plan(adapter_name, inputs, loss_inputs, False, return_logits=return_logits)

    def forward_backward_targets(
        self,
        sequences: Sequence[TargetSequence],
        loss_fn: LossFn | None = None,
        adapter_name: str | None = None,
        backward: bool = True,
    ) -> TargetsOutput:
        """Log-probs of arbitrary per-position targets (Tinker's layout), a caller's loss over them, and backward.

        ``loss_fn(logps)`` gets one float32 tensor per sequence, shaped like its
        targets and differentiable, and returns ``(loss, metrics)``. With
        ``backward`` (needs ``loss_fn``) the loss is back-propagated (scaled by
        1/gradient_accumulation_steps); on any error, a non-finite loss included,
        gradients stay as they were. Without, it runs in eval mode under no_grad.
        """
        state = self.train_state(adapter_name)
        self._wrap()
        limits = model_limits(self.model)
        plan = TargetsPlan(state, AdapterResult(adapter_name), sequences, loss_fn, backward, limits, self.parallel)
        return self._run(plan, None, TargetsOutput)

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        """Metrics since the previous call (then reset): loss, accuracy, grad_norm, lr, tokens/s, user metrics."""
        return self.train_state(adapter_name).report(is_training)

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int = 64, adapter_name: str | None = None
    ) -> list[int]:
        """Greedy continuation of one prompt with this adapter: a quick check of what training did.

        Batched sampling with temperatures, log-probs and per-row adapters is the sampler's job.
        Under FSDP it is a collective: every rank calls it with the same prompt.
        """
        state = self.train_state(adapter_name)
        return stepwise.generate(self._step_host(), state, input_ids, max_new_tokens)

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        name: str,
        output_dir: str | Path | None = None,
        save_optimizer: bool = True,
        adapter_name: str | None = None,
        dataloader: Any = None,
    ) -> str:
        """Write a checkpoint directory ``output_dir/name`` atomically; returns its path.

        LoRA adapters are saved in PEFT format, the full model as a transformers
        directory. ``save_optimizer`` adds optimizer and scheduler state; a
        ``dataloader`` (anything with ``get_state()``) records its position.
        """
        return str(save_load.save(self, self.train_state(adapter_name), name, output_dir, save_optimizer, dataloader))

    def load(self, path: str | Path, adapter_name: str | None = None, load_optimizer: bool = False) -> None:
        """Load weights (and optionally optimizer state) saved by :meth:`save`; adds the adapter if missing."""
        save_load.load_weights(self, Path(path), adapter_name, load_optimizer)

    def resume_from_checkpoint(self, path: str | Path, adapter_name: str | None = None, dataloader: Any = None) -> None:
        """Restore weights, optimizer, scheduler, step counters, RNG and (given one) the dataloader position."""
        save_load.resume(self, Path(path), adapter_name, dataloader)

    # ------------------------------------------------------------------ back-end hooks

    def _parallelism(self) -> Parallelism:
        """How this model's computations run across processes (its ``device_mesh``)."""
        return parallelism_for(self.device_mesh, self.device, type(self))

    def _load_model(
        self,
        gradient_checkpointing: CheckpointingPolicy,
        kernels: KernelsSpec,
        patches: Sequence[PatchSpec],
        options: dict[str, Any],
    ) -> Any:
        """The model at ``self.model_path`` on ``self.device``, in training mode."""
        return load_causal_lm(self.model_path, self.device, gradient_checkpointing, kernels, patches, **options)

    def load_full_weights(self, path: Path) -> None:
        """Replace every weight by a full checkpoint's (a transformers directory); nothing changes on a mismatch."""
        save_load.load_full_weights(self, path)

    @abstractmethod
    def _route_rows(
        self, row_adapters: Sequence[str | None], batch: Mapping[str, torch.Tensor] | None
    ) -> AbstractContextManager[Any]:
        """Within the block, row ``i`` of every forward uses adapter ``row_adapters[i]`` (``None``: no adapter).

        ``batch`` is the forward's batch, whose images (if any) belong to rows too.
        """

    @abstractmethod
    def adapter_state_dict(self, state: TrainState) -> dict[str, torch.Tensor]:
        """The adapter's weights under PEFT's keys (sharded DTensors under FSDP: ``save`` gathers them)."""

    @abstractmethod
    def write_adapter_files(self, state: TrainState, directory: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write the adapter's config and its weights ``tensors`` in PEFT's format into ``directory``."""

    @abstractmethod
    def load_adapter_weights(self, adapter_name: str, directory: Path) -> None:
        """Load weights written by :meth:`write_adapter_files` (or by PEFT) into the existing adapter."""

    # ------------------------------------------------------------------ internals

    def train_state(self, adapter_name: str | None) -> TrainState:
        """The :class:`TrainState` of ``adapter_name`` (the only adapter, or the full model, when ``None``)."""
        if not self._states and adapter_name is None:
            if not self.trains_full_model:
                raise ConfigurationError(
                    f"{type(self).__name__} trains LoRA adapters only: call add_adapter_to_model(...) first"
                )
            params = [p for p in self.model.parameters() if p.requires_grad]
            self._states[FULL_MODEL] = new_state(FULL_MODEL, params, 1, self.pad_token_id)
        return find_state(self._states, adapter_name)

    def _configured(self, adapter_name: str | None) -> TrainState:
        """The state a ``set_*`` call configures, marked so (call it once the new component is built)."""
        state = self.train_state(adapter_name)
        state.configured = True
        return state

    def _wrap(self) -> None:
        """Wrap the model for data parallelism on first use (adapters are all added by then)."""
        self.parallel.wrap(self.model, self._states.values())

    def _step_host(self) -> stepwise.StepHost:
        self._wrap()
        return stepwise.StepHost(
            self._engine, self.parallel, self._batches, self.model, self._route_rows, self.pad_token_id
        )

    def _run_loss_plan(
        self,
        adapter_name: str | None,
        inputs: Any,
        loss_inputs: Mapping[str, Any],
        train: bool,
        micro_batch_size: int | None = None,
        return_logits: bool = False,
    ) -> ModelOutput:
        """One adapter's ``forward_backward`` (``train``) or ``forward_only`` through the pass engine."""
        state = self.train_state(adapter_name)
        self._wrap()
        with self.parallel.all_or_none():
            features = self._batches.features(state, inputs)
        result = AdapterResult(adapter_name)
        plan = LossPlan(state, result, features, loss_inputs, self.parallel, train, micro_batch_size, return_logits)
        return self._run(plan, micro_batch_size, ModelOutput)

    def _run(self, plan: Plan, micro_batch_size: int | None, output_type: type[OutputT]) -> OutputT:
        self._engine.run([plan], micro_batch_size)
        output = plan.result.unwrap()
        assert isinstance(output, output_type)
        return output
