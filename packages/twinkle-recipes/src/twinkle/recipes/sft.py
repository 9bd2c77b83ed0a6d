"""``twinkle sft``: supervised fine-tuning (LoRA or full parameters) from a YAML file and flags.

    twinkle sft --config sft.yaml --lr 1e-4

The same loop as ``cookbook/sft/self_cognition.py``, with every choice in
:class:`SFTConfig`. Checkpoints hold the dataloader position, so
``--resume-from <dir>`` continues a run exactly where it stopped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

import twinkle
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError
from twinkle.model import TransformersModel
from twinkle.recipes.config import load_config
from twinkle.registry import build


@dataclass
class SFTConfig:
    """Options of ``twinkle sft``; ``lora: null`` trains all parameters."""

    model_id: str = "builtin://qwen3-tiny"
    dataset: str = "builtin://self-cognition"
    split: str = "train"
    preprocessor: str | None = "SelfCognitionProcessor"
    preprocessor_args: dict[str, Any] = field(
        default_factory=lambda: {"model_name": "Twinkle", "model_author": "ModelScope"}
    )
    max_length: int = 256
    truncation_strategy: str = "delete"
    lora: dict[str, Any] | None = field(
        default_factory=lambda: {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    )
    optimizer: str = "AdamW"
    lr: float = 5e-3
    weight_decay: float = 0.0
    lr_scheduler: str = "CosineWarmupScheduler"
    warmup_steps: int = 5
    epochs: int = 10
    batch_size: int = 8
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int = 1
    padding_free: bool = False
    max_grad_norm: float = 1.0
    seed: int = 42
    output_dir: str = "outputs/sft"
    save_every_epochs: int = 1
    resume_from: str | None = None

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "max_length", "gradient_accumulation_steps", "save_every_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.lr, (int, float)) or self.lr <= 0:
            raise ConfigurationError(f"lr must be a positive number, got {self.lr!r}")


def build_dataloader(config: SFTConfig) -> DataLoader:
    dataset = Dataset(DatasetMeta(config.dataset, split=config.split))
    dataset.set_template(
        "Template",
        model_id=config.model_id,
        max_length=config.max_length,
        truncation_strategy=config.truncation_strategy,
    )
    if config.preprocessor:
        dataset.map(build("preprocessor", config.preprocessor, **config.preprocessor_args))
    dataset.encode()
    return DataLoader(dataset=dataset, batch_size=config.batch_size, shuffle=True, seed=config.seed)


def build_model(config: SFTConfig, num_training_steps: int) -> TransformersModel:
    model = TransformersModel(model_id=config.model_id)
    if config.lora is not None:
        model.add_adapter_to_model("default", config.lora, config.gradient_accumulation_steps)
    model.set_optimizer(config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    model.set_lr_scheduler(
        config.lr_scheduler,
        num_warmup_steps=min(config.warmup_steps, num_training_steps),  # short runs warm up for the whole run
        num_training_steps=num_training_steps,
    )
    if config.padding_free:
        model.set_processor("InputProcessor", padding_free=True)
    return model


def run(config: SFTConfig) -> dict[str, Any]:
    """Train; returns a summary (losses per step, checkpoint path)."""
    twinkle.initialize(seed=config.seed)
    dataloader = build_dataloader(config)
    steps_per_epoch = len(dataloader) // config.gradient_accumulation_steps
    model = build_model(config, num_training_steps=max(1, config.epochs * steps_per_epoch))
    if config.resume_from:
        model.resume_from_checkpoint(config.resume_from, dataloader=dataloader)
    losses: list[float] = []
    checkpoint = None
    position = dataloader.get_state()  # not at zero when resumed
    finished = position["batches_consumed"] >= len(dataloader)  # a finished epoch rolls over on iteration
    start_epoch = position["epoch"] + int(finished)
    done = start_epoch * len(dataloader) + (0 if finished else position["batches_consumed"])
    progress = tqdm(total=config.epochs * len(dataloader), initial=done, desc="sft")
    for epoch in range(start_epoch, config.epochs):
        for batch in dataloader:
            output = model.forward_backward(inputs=batch, micro_batch_size=config.micro_batch_size)
            model.clip_grad_and_step(max_grad_norm=config.max_grad_norm)
            losses.append(output.loss)
            progress.update()
            progress.set_postfix(loss=f"{output.loss:.3f}")
        if (epoch + 1) % config.save_every_epochs == 0 or epoch + 1 == config.epochs:
            checkpoint = model.save(f"epoch-{epoch + 1}", output_dir=config.output_dir, dataloader=dataloader)
    progress.close()
    summary = {
        "losses": losses,
        "checkpoint": checkpoint,
        "metrics": model.calculate_metric(),
        "config": asdict(config),
    }
    os.makedirs(config.output_dir, exist_ok=True)
    with open(os.path.join(config.output_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    return summary


def main(argv: Sequence[str]) -> int:
    config = load_config(SFTConfig, argv, prog="twinkle sft", description=__doc__.splitlines()[0])
    summary = run(config)
    losses = summary["losses"]
    if losses:
        print(f"trained {len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"checkpoint: {summary['checkpoint']}")
    return 0
