"""DPO on the embedded preference set: LoRA on the embedded default model, on a CPU.

    python cookbook/rl/dpo.py
    torchrun --nproc_per_node 2 cookbook/rl/dpo.py                  # data parallel (DDP)
    FSDP_SIZE=2 torchrun --nproc_per_node 2 cookbook/rl/dpo.py      # FSDP2

Each batch holds the chosen answers followed by the rejected ones (the layout
``DPOLoss`` expects). The reference model is the frozen base model, read once
per batch with ``forward_only``. Preference accuracy on held-out pairs (the
share of pairs whose chosen answer gets the higher implicit reward) is printed
before and after training. Under torchrun each rank trains on its slice of
every batch's pairs and lays them out itself, so pairs are never split; the
loss and metrics are the global batch's. MAX_STEPS stops early; the per-step
losses are written to loss.json; EVAL_PAIRS scores only the first held-out pairs.

The recipe builds its parts from the classes in a ``Components``: twinkle's here,
twinkle_client's in cookbook/client/twinkle/self_host/dpo.py, which runs this
same ``main`` on a Twinkle server.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

import twinkle
from twinkle import DeviceMesh
from twinkle.metric import DPOMetric
from twinkle.preprocessor import DPOProcessor

if TYPE_CHECKING:
    from twinkle.dataset import Dataset
    from twinkle.model import TransformersModel

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
EPOCHS = int(os.environ.get("EPOCHS", 1))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))  # pairs per step
BETA = float(os.environ.get("BETA", 0.1))
LEARNING_RATE = float(os.environ.get("LR", 2e-3))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/dpo")
MAX_STEPS = int(os.environ.get("MAX_STEPS", 0))  # 0: every step of EPOCHS epochs
EVAL_PAIRS = int(os.environ.get("EVAL_PAIRS", 0))  # held-out pairs to score; 0: all of them
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # set by torchrun
FSDP_SIZE = int(os.environ.get("FSDP_SIZE", 1))  # the rest of the processes replicate (dp_size)


@dataclass(frozen=True)
class Components:
    """The classes the recipe builds: twinkle's (:func:`local_components`) or their twinkle_client twins.

    The caller imports them, so a remote run never imports the torch-backed modules.
    """

    LoraConfig: Any
    Dataset: Any
    DatasetMeta: Any
    DataLoader: Any
    TransformersModel: Any


def local_components() -> Components:
    """Training in this process."""
    from peft import LoraConfig

    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.model import TransformersModel

    return Components(LoraConfig, Dataset, DatasetMeta, DataLoader, TransformersModel)


def create_dataset(components: Components, split: str) -> Dataset:
    dataset = components.Dataset(components.DatasetMeta("builtin://preference-mini", split=split))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256)
    dataset.map(DPOProcessor())
    dataset.encode()  # each feature carries its rejected alternative under 'rejected'
    return dataset


def as_pairs(batch: list) -> list:
    """Chosen features first, then their rejected alternatives in the same order."""
    return [feature for feature in batch] + [feature["rejected"] for feature in batch]


def sequence_logps(model: TransformersModel, features: list) -> list[float]:
    return [float(logps.sum()) for logps in model.forward_only(inputs=features).logps]


def preference_accuracy(
    components: Components, policy: TransformersModel, reference: TransformersModel, dataset: Dataset
) -> float:
    """The share of held-out pairs ranked right; every rank scores all of them (under torchrun too)."""
    metric, size = DPOMetric(), min(len(dataset), EVAL_PAIRS or len(dataset))
    # A mesh of one rank: whole batches for every process, not a data-parallel slice.
    whole = DeviceMesh.from_sizes(world_size=1)
    loader = components.DataLoader(dataset=dataset, batch_size=BATCH_SIZE, device_mesh=whole, rank=0)
    for index, batch in enumerate(itertools.islice(loader, math.ceil(size / BATCH_SIZE))):
        pairs = as_pairs(batch[: size - index * BATCH_SIZE])
        policy_logps, reference_logps = sequence_logps(policy, pairs), sequence_logps(reference, pairs)
        rewards = [BETA * (p - r) for p, r in zip(policy_logps, reference_logps, strict=True)]
        half = len(pairs) // 2
        metric.accumulate(chosen_rewards=rewards[:half], rejected_rewards=rewards[half:])
    return metric.calculate()["dpo/accuracy"]


def main(components: Components) -> None:
    # The components (DataLoader, TransformersModel) default to this mesh; one process: a mesh of one rank.
    twinkle.initialize(seed=42, global_device_mesh=DeviceMesh.from_sizes(world_size=WORLD_SIZE, fsdp_size=FSDP_SIZE))
    train, test = create_dataset(components, "train"), create_dataset(components, "test")
    reference = components.TransformersModel(model_id=MODEL_ID)  # frozen: only read with forward_only
    policy = components.TransformersModel(model_id=MODEL_ID)
    policy.add_adapter_to_model("default", components.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    policy.set_loss("DPOLoss", beta=BETA)
    policy.set_optimizer("AdamW", lr=LEARNING_RATE)
    # Before training policy == reference, every implicit reward is 0 and ties count as wrong.
    before = preference_accuracy(components, policy, reference, test)
    report(f"held-out preference accuracy before training: {before:.3f}")

    dataloader = components.DataLoader(dataset=train, batch_size=BATCH_SIZE, shuffle=True, min_batch_size=BATCH_SIZE)
    steps = min(EPOCHS * len(dataloader), MAX_STEPS or EPOCHS * len(dataloader))
    batches = itertools.islice((batch for _ in range(EPOCHS) for batch in dataloader), steps)  # this rank's pairs
    losses = []
    for batch in tqdm(batches, total=steps, desc="dpo", disable=not twinkle.is_master()):
        pairs = as_pairs(batch)
        output = policy.forward_backward(inputs=pairs, ref_logps=sequence_logps(reference, pairs))
        policy.clip_grad_and_step()
        losses.append(output.loss)  # the global batch's
    metrics = policy.calculate_metric()
    accuracy = preference_accuracy(components, policy, reference, test)
    checkpoint = policy.save("dpo-checkpoint", output_dir=OUTPUT_DIR)  # every rank takes part; rank 0 writes
    if twinkle.is_master():
        os.makedirs(OUTPUT_DIR, exist_ok=True)  # remotely the checkpoint stays on the server
        with open(os.path.join(OUTPUT_DIR, "loss.json"), "w") as handle:
            json.dump(losses, handle)
    report(
        f"training preference accuracy {metrics['loss/accuracy']:.3f}, margin {metrics['loss/margin']:.3f}; "
        f"held-out preference accuracy after training: {accuracy:.3f}; adapter saved to {checkpoint}"
    )


def report(line: str) -> None:
    if twinkle.is_master():
        print(line, flush=True)


if __name__ == "__main__":
    main(local_components())
