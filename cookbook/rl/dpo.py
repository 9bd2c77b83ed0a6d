"""DPO on the embedded preference set: LoRA on the embedded default model, on a CPU.

    python cookbook/rl/dpo.py

Each batch holds the chosen answers followed by the rejected ones (the layout
``DPOLoss`` expects). The reference model is the frozen base model, read once
per batch with ``forward_only``. Preference accuracy on held-out pairs (the
share of pairs whose chosen answer gets the higher implicit reward) is printed
before and after training.
"""

import os

from peft import LoraConfig
from tqdm import tqdm

import twinkle
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import DPOMetric
from twinkle.model import TransformersModel
from twinkle.preprocessor import DPOProcessor

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
EPOCHS = int(os.environ.get("EPOCHS", 1))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))  # pairs per step
BETA = float(os.environ.get("BETA", 0.1))
LEARNING_RATE = float(os.environ.get("LR", 2e-3))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/dpo")


def create_dataset(split: str) -> Dataset:
    dataset = Dataset(DatasetMeta("builtin://preference-mini", split=split))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256)
    dataset.map(DPOProcessor())
    dataset.encode()  # each feature carries its rejected alternative under 'rejected'
    return dataset


def as_pairs(batch: list) -> list:
    """Chosen features first, then their rejected alternatives in the same order."""
    return [feature for feature in batch] + [feature["rejected"] for feature in batch]


def sequence_logps(model: TransformersModel, features: list) -> list[float]:
    return [float(logps.sum()) for logps in model.forward_only(inputs=features).logps]


def preference_accuracy(policy: TransformersModel, reference: TransformersModel, dataset: Dataset) -> float:
    metric = DPOMetric()
    for batch in DataLoader(dataset=dataset, batch_size=BATCH_SIZE):
        pairs = as_pairs(batch)
        policy_logps, reference_logps = sequence_logps(policy, pairs), sequence_logps(reference, pairs)
        rewards = [BETA * (p - r) for p, r in zip(policy_logps, reference_logps, strict=True)]
        metric.accumulate(chosen_rewards=rewards[: len(batch)], rejected_rewards=rewards[len(batch) :])
    return metric.calculate()["dpo/accuracy"]


def main() -> None:
    twinkle.initialize(seed=42)
    train, test = create_dataset("train"), create_dataset("test")
    reference = TransformersModel(model_id=MODEL_ID)  # frozen: only read with forward_only
    policy = TransformersModel(model_id=MODEL_ID)
    policy.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    policy.set_loss("DPOLoss", beta=BETA)
    policy.set_optimizer("AdamW", lr=LEARNING_RATE)
    # Before training policy == reference, every implicit reward is 0 and ties count as wrong.
    print(f"held-out preference accuracy before training: {preference_accuracy(policy, reference, test):.3f}")

    dataloader = DataLoader(dataset=train, batch_size=BATCH_SIZE, shuffle=True, min_batch_size=BATCH_SIZE)
    for _ in range(EPOCHS):
        for batch in tqdm(dataloader, desc="dpo"):
            pairs = as_pairs(batch)
            policy.forward_backward(inputs=pairs, ref_logps=sequence_logps(reference, pairs))
            policy.clip_grad_and_step()
    metrics = policy.calculate_metric()
    accuracy = preference_accuracy(policy, reference, test)
    checkpoint = policy.save("dpo-checkpoint", output_dir=OUTPUT_DIR)
    print(
        f"training preference accuracy {metrics['loss/accuracy']:.3f}, margin {metrics['loss/margin']:.3f}; "
        f"held-out preference accuracy after training: {accuracy:.3f}; adapter saved to {checkpoint}"
    )


if __name__ == "__main__":
    main()
