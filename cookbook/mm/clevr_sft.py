"""Vision-language SFT on the embedded image questions: builtin://qwen3-vl-tiny learns builtin://clevr-mini.

Full-parameter training (the vision tower included) of the randomly initialised Qwen3-VL builtin on the
1000 training scenes, then greedy answers from ``TorchSampler`` on the 200 held-out scenes, scored by exact
match against the answers computed from each scene. Printed beside the accuracy: the held-out loss before
and after, and two baselines that never look at the image: the most common training answer, and the most
common training answer for each question type (what a model reading only the question could reach).

    .venv/bin/python cookbook/mm/clevr_sft.py            # EPOCHS=6 by default; LR, BATCH_SIZE, SEED too
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import twinkle
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import resolve_dataset
from twinkle.model import TransformersModel
from twinkle.preprocessor import CLEVRProcessor
from twinkle.sampler import TorchSampler

MODEL_ID = "builtin://qwen3-vl-tiny"
DATA_ID = "builtin://clevr-mini"
EPOCHS = int(os.environ.get("EPOCHS", "6"))
LR = float(os.environ.get("LR", "1e-3"))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", "16"))
SEED = int(os.environ.get("SEED", "42"))


def encoded(split: str, include_answer: bool) -> Dataset:
    dataset = Dataset(DatasetMeta(DATA_ID, split=split))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256, enable_thinking=False)
    dataset.map(CLEVRProcessor(include_answer=include_answer))
    dataset.encode(add_generation_prompt=not include_answer)
    return dataset


def rows(split: str) -> list[dict]:
    with open(os.path.join(resolve_dataset(DATA_ID), f"{split}.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def baselines(train: list[dict], test: list[dict]) -> tuple[float, float]:
    """Held-out accuracy of the most common training answer, overall and per question type."""
    overall = Counter(row["answer"] for row in train).most_common(1)[0][0]
    by_type = {
        kind: Counter(row["answer"] for row in train if row["type"] == kind).most_common(1)[0][0]
        for kind in {row["type"] for row in train}
    }
    return (
        sum(row["answer"] == overall for row in test) / len(test),
        sum(row["answer"] == by_type[row["type"]] for row in test) / len(test),
    )


def accuracy(sampler: TorchSampler, prompts: Dataset) -> tuple[float, dict[str, float]]:
    """Greedy answers' exact-match accuracy on ``prompts``, overall and per question type."""
    features = [prompts[i] for i in range(len(prompts))]
    response = sampler.sample(features, SamplingParams(max_tokens=4, temperature=0.0))
    hits: dict[str, list[bool]] = {}
    for sequence in response.sequences:
        user_data = features[sequence.input_index]["user_data"]
        hits.setdefault(user_data["type"], []).append(sequence.decoded.strip() == user_data["answer"])
    overall = sum(sum(values) for values in hits.values()) / len(response.sequences)
    return overall, {kind: round(sum(values) / len(values), 3) for kind, values in sorted(hits.items())}


def main() -> None:
    started = time.time()
    twinkle.initialize(seed=SEED)
    train, test_prompts = encoded("train", True), encoded("test", False)
    dataloader = DataLoader(dataset=train, batch_size=BATCH_SIZE, shuffle=True, seed=SEED)
    model = TransformersModel(model_id=MODEL_ID)
    model.set_optimizer("AdamW", lr=LR)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=10, num_training_steps=EPOCHS * len(dataloader))
    sampler = TorchSampler(model_id=MODEL_ID)
    sampler.set_template("Template", model_id=MODEL_ID, enable_thinking=False)
    before, _ = accuracy(sampler, test_prompts)
    first_loss = None
    for epoch in range(EPOCHS):
        for batch in dataloader:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            first_loss = first_loss if first_loss is not None else model.calculate_metric(is_training=True)["loss"]
        metrics = model.calculate_metric(is_training=True)
        elapsed = time.time() - started
        loss, token_accuracy = metrics["loss"], metrics["accuracy"]
        print(f"epoch {epoch + 1}: loss {loss:.3f} token accuracy {token_accuracy:.3f} ({elapsed:.0f} s)")
    CheckpointEngineManager(model=model, sampler=sampler).sync_weights(merge_and_sync=True)  # every weight
    after, by_type = accuracy(sampler, test_prompts)
    majority, per_type = baselines(rows("train"), rows("test"))
    print(f"training loss: first step {first_loss:.3f} -> last epoch {metrics['loss']:.3f}")
    print(
        f"held-out answer accuracy: {before:.3f} before -> {after:.3f} after; baselines without the image: "
        f"majority answer {majority:.3f}, majority answer per question type {per_type:.3f} "
        f"({time.time() - started:.0f} s)"
    )
    print(f"held-out accuracy per question type: {by_type}")


if __name__ == "__main__":
    main()
