"""Saving, loading and resuming ``TransformersModel`` checkpoints.

Layout of ``<output_dir>/<name>/`` (written atomically, see :mod:`.files`):

- LoRA: ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT format);
  full model: a transformers directory (config, safetensors, tokenizer files);
- ``twinkle_state.json``: adapter name, step counters, dataloader position;
- ``optimizer.pt``: optimizer and LR-scheduler state (when saved with ``save_optimizer``);
- ``rng_state.pt``: Python, numpy and torch RNG states, so a resumed run draws the same numbers.

Under data parallelism every rank calls ``save``: FSDP shards are gathered
into full tensors (a collective), rank 0 writes the one consolidated
checkpoint, and no rank returns before it is written (or failed, on all ranks
alike). It loads in one process like any other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from twinkle.errors import ConfigurationError, ResourceNotFoundError
from twinkle.model import peft_adapters
from twinkle.model.checkpoints.files import (
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    atomic_directory,
    capture_rng_state,
    read_json,
    restore_rng_state,
    write_json,
)
from twinkle.model.train_state import TrainState
from twinkle.module import keeping_implementation

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from twinkle.model.training_model import TrainingModel

FORMAT_VERSION = 1
DEFAULT_OUTPUT_DIR = "outputs"
_TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template", "added_tokens")


def save(
    owner: TrainingModel,
    state: TrainState,
    name: str,
    output_dir: str | Path | None,
    save_optimizer: bool,
    dataloader: Any,
) -> Path:
    if not name or name in (".", "..") or Path(name).name != name:
        raise ConfigurationError(f"checkpoint name must be a plain directory name, got {name!r}")
    final = Path(output_dir or os.environ.get("TWINKLE_OUTPUT_DIR", DEFAULT_OUTPUT_DIR)) / name
    # Every rank gathers (FSDP shards are all-gathered); only the writer writes.
    model = owner.model
    tensors = owner.parallel.gathered(
        model, owner.adapter_state_dict(state) if state.is_adapter else model.state_dict()
    )
    optimizer_state = None
    if save_optimizer and state.optimizer is not None:
        optimizer_state = {
            "optimizer": owner.parallel.gathered_optimizer_state(model, state.optimizer),
            "lr_scheduler": state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None,
        }
    with owner.parallel.all_or_none():  # also the barrier: nobody returns before the checkpoint exists
        if owner.parallel.is_writer:
            _write(owner, state, final, tensors, optimizer_state, dataloader)
    return final


def _write(
    owner: TrainingModel,
    state: TrainState,
    final: Path,
    tensors: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    dataloader: Any,
) -> None:
    with atomic_directory(final) as tmp:
        if state.is_adapter:
            owner.write_adapter_files(state, tmp, tensors)
        else:
            owner.model.save_pretrained(str(tmp), state_dict=tensors, safe_serialization=True)
            _copy_tokenizer_files(Path(owner.model_path), tmp)
        write_json(
            tmp / STATE_FILE,
            {
                "format_version": FORMAT_VERSION,
                "adapter_name": state.name if state.is_adapter else None,
                "base_model": owner.model_path,
                "counters": state.counters(),
                "dataloader": dataloader.get_state() if dataloader is not None else None,
            },
        )
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        torch.save(capture_rng_state(), tmp / RNG_FILE)


def load_weights(owner: TrainingModel, path: Path, adapter_name: str | None, load_optimizer: bool) -> TrainState:
    """Load weights into the matching adapter (created from the checkpoint's config if missing).

    A missing or unusable optimizer state, or full weights that do not fit the
    model, are found before the first weight changes: such a load leaves the model as it was.
    """
    if not path.is_dir():
        raise ResourceNotFoundError(f"checkpoint directory {path} does not exist")
    meta = read_json(path / STATE_FILE) if (path / STATE_FILE).is_file() else {}
    name = None
    if (path / peft_adapters.ADAPTER_CONFIG).is_file():
        name = adapter_name or meta.get("adapter_name") or path.name
    elif owner.adapter_names:
        raise ConfigurationError(
            f"{path} holds full model weights but this model trains adapters {owner.adapter_names}"
        )
    optimizer_state = _read_optimizer_state(owner, path, name) if load_optimizer else None
    if name is None:
        owner.load_full_weights(path)
    elif name in owner.adapter_names:
        owner.load_adapter_weights(name, path)
    else:
        gradient_accumulation = meta.get("counters", {}).get("gradient_accumulation_steps", 1)
        owner.add_adapter_to_model(name, path, gradient_accumulation_steps=gradient_accumulation)
    state = owner.train_state(name)
    if optimizer_state is not None:
        optimizer = state.require_optimizer()
        local = owner.parallel.local_optimizer_state(owner.model, optimizer_state["optimizer"], optimizer)
        optimizer.load_state_dict(keeping_implementation(local, optimizer))
        if optimizer_state["lr_scheduler"] is not None:
            state.lr_scheduler.load_state_dict(optimizer_state["lr_scheduler"])
    return state


def resume(owner: TrainingModel, path: Path, adapter_name: str | None, dataloader: Any) -> None:
    if not (path / STATE_FILE).is_file():
        raise ResourceNotFoundError(f"{path} is not a checkpoint written by TransformersModel.save (no {STATE_FILE})")
    meta = read_json(path / STATE_FILE)
    if dataloader is not None and meta.get("dataloader") is None:
        raise ConfigurationError(f"{path} was saved without a dataloader position; pass dataloader= to save()")
    state = load_weights(owner, path, adapter_name, load_optimizer=True)
    counters = meta["counters"]
    state.global_step = counters["global_step"]
    state.accumulated = counters["accumulated"]
    state.gradient_accumulation_steps = counters["gradient_accumulation_steps"]
    restore_rng_state(torch.load(path / RNG_FILE, weights_only=False))
    if dataloader is not None:
        dataloader.load_state(meta["dataloader"])


def _read_optimizer_state(owner: TrainingModel, path: Path, name: str | None) -> dict[str, Any]:
    """The saved optimizer and scheduler state, once sure there is an optimizer (and scheduler) to take it."""
    if not (path / OPTIMIZER_FILE).is_file():
        raise ResourceNotFoundError(f"{path} has no optimizer state (saved with save_optimizer=False)")
    if name is not None and name not in owner.adapter_names:
        raise ConfigurationError(
            f"add adapter {name!r} and call set_optimizer(...) before loading its optimizer state from {path}"
        )
    state = owner.train_state(name)
    state.require_optimizer()
    saved = torch.load(path / OPTIMIZER_FILE, weights_only=False)
    if saved["lr_scheduler"] is not None and state.lr_scheduler is None:
        raise ConfigurationError(f"{path} has LR-scheduler state: call set_lr_scheduler(...) before resuming")
    return saved


def read_weight_files(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers checkpoint directory's ``*.safetensors`` files, by its saved name."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ResourceNotFoundError(f"{path} has neither an adapter nor *.safetensors model weights")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(file)))
    return state_dict


def load_full_weights(owner: TrainingModel, path: Path) -> None:
    """A transformers checkpoint's weights into ``owner``'s model, checked whole before any is copied."""
    model: PreTrainedModel = owner.model
    state_dict = read_weight_files(path)
    expected = model.state_dict()
    if set(state_dict) - set(expected) and set(expected) - set(state_dict):
        # Saved in the checkpoint's own layout (transformers' save_pretrained turns fused MoE experts back
        # into per-expert weights): transformers' loading converts it to the model's.
        state_dict = type(model).from_pretrained(str(path), dtype=next(model.parameters()).dtype).state_dict()
    # Expert parallelism: this rank's experts of the whole tensors.
    state_dict = {
        k: owner.parallel.local_part(model, expected[k], v) if k in expected else v for k, v in state_dict.items()
    }
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if model.config.tie_word_embeddings else set()
    missing = [k for k in expected if k not in state_dict and k not in tied]
    unexpected = [k for k in state_dict if k not in expected]
    resized = [k for k in state_dict if k in expected and state_dict[k].shape != expected[k].shape]
    if missing or unexpected or resized:
        raise ConfigurationError(
            f"{path} does not match this model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"other shape {resized[:3]}"
        )
    model.load_state_dict(state_dict, strict=False)


def _copy_tokenizer_files(source: Path, target: Path) -> None:
    for file in source.iterdir():
        if file.is_file() and file.name.startswith(_TOKENIZER_FILE_PREFIXES):
            shutil.copy2(file, target / file.name)
