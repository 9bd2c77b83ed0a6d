"""One training process of ``test_resume.py``: LoRA SFT on self-cognition, printing each step's loss as JSON.

``--steps N`` trains N steps; ``--save-after K`` writes a resumable checkpoint
(weights, optimizer, scheduler, RNG, dataloader position) after step K;
``--resume DIR`` continues from such a checkpoint, waiting for it to appear
(saves are atomic: once the directory exists it is complete), so this process
can start up while another is still training; ``--final DIR`` saves the
adapter at the end. Losses are printed with ``float.hex`` so the test compares
them bit for bit; every process runs on one intra-op thread, so all of them run the same kernels.
"""

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.utils import seed_everything

NUM_ROWS = 24  # batch 4: six steps per epoch, so steps 6-10 cross into the second epoch
TOTAL_STEPS = 10


def build() -> tuple[TransformersModel, DataLoader]:
    seed_everything(0)
    dataset = Dataset(DatasetMeta("builtin://self-cognition", data_slice=range(NUM_ROWS)))
    dataset.set_template("Template", model_id="builtin://qwen3-tiny", max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "ModelScope"))
    dataset.encode()
    loader = DataLoader(dataset, batch_size=4, shuffle=True, seed=7)
    model = TransformersModel(device="cpu")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1)
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-3)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=TOTAL_STEPS)
    return model, loader


def batches(loader: DataLoader) -> Iterator[Any]:
    """Batch after batch across epochs; the loader's own position says where it resumes."""
    while True:
        yield from loader


def wait_for(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-after", type=int)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--resume")
    parser.add_argument("--final")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, loader = build()
    if args.resume:
        wait_for(Path(args.resume))
        model.resume_from_checkpoint(args.resume, dataloader=loader)
    losses = []
    for step, batch in zip(range(1, args.steps + 1), batches(loader), strict=False):
        output = model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(float(output.loss).hex())
        if step == args.save_after:
            model.save("resumable", output_dir=args.checkpoint_dir, dataloader=loader)
    if args.final:
        model.save("final", output_dir=args.final, save_optimizer=False)
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
