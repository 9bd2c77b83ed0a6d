"""DPO with the unmodified ``tinker`` SDK against a Twinkle server: a custom loss over log-probs.

Tinker has no DPO loss on the server; ``forward_backward_custom`` computes any loss here from the
policy's per-token log-probs (the SDK differentiates it with torch and sends the gradients back as
per-token weights). The reference is the frozen base model, read through a sampling client's
``compute_logprobs``. The pairs come from Twinkle's dataset pipeline (builtin://preference-mini,
the base model's chat template) and become ``Datum``s through ``input_feature_to_datum``. Held-out
preference accuracy (the share of pairs whose chosen answer gets the higher implicit reward) is
printed before and after training. Start a server and create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/tinker/self_host/dpo.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. Knobs: EPOCHS, BATCH_SIZE (pairs per step),
MAX_STEPS (0: every step of EPOCHS epochs), EVAL_PAIRS (0: every held-out pair), BETA, LR,
LORA_RANK, MODEL_ID (the server's base model).
"""

import itertools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from twinkle import init_tinker_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import DPOMetric
from twinkle.preprocessor import DPOProcessor
from twinkle_client import input_feature_to_datum

init_tinker_client()  # TINKER_BASE_URL / TINKER_API_KEY from TWINKLE_BASE_URL / TWINKLE_API_KEY

from tinker import SamplingClient, ServiceClient, TrainingClient, types  # noqa: E402 (after init_tinker_client)

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
EPOCHS = int(os.environ.get("EPOCHS", 1))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))
MAX_STEPS = int(os.environ.get("MAX_STEPS", 0))
EVAL_PAIRS = int(os.environ.get("EVAL_PAIRS", 0))
BETA = float(os.environ.get("BETA", 0.1))
LEARNING_RATE = float(os.environ.get("LR", 2e-3))
LORA_RANK = int(os.environ.get("LORA_RANK", 16))
LossFn = Callable[[list[types.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def create_dataset(split: str) -> Dataset:
    dataset = Dataset(DatasetMeta("builtin://preference-mini", split=split))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256)
    dataset.map(DPOProcessor())
    dataset.encode()  # each feature carries its rejected alternative under 'rejected'
    return dataset


def as_pairs(batch: list) -> list[types.Datum]:
    """The chosen answers' datums, then the rejected ones' in the same order."""
    return [input_feature_to_datum(feature) for feature in batch] + [
        input_feature_to_datum(feature["rejected"]) for feature in batch
    ]


def reference_logps(reference: SamplingClient, data: list[types.Datum]) -> list[float]:
    """Each datum's summed log-prob of its trained tokens under the base model."""
    futures = []
    for datum in data:  # all requests first, then the answers
        tokens = [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])]
        futures.append(reference.compute_logprobs(types.ModelInput.from_ints(tokens)))
    sums = []
    for datum, future in zip(data, futures, strict=True):
        token_logps = future.result()[1:]  # the first token has no log-prob; position t predicts token t + 1
        weights = datum.loss_fn_inputs["weights"].to_numpy()
        sums.append(sum(float(w) * lp for w, lp in zip(weights, token_logps, strict=True) if w))
    return sums


def dpo_loss(reference: list[float]) -> LossFn:
    """The DPO loss of a batch laid out as :func:`as_pairs` lays it out, against these reference log-probs."""

    def loss_fn(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        weights = [torch.tensor(datum.loss_fn_inputs["weights"].to_numpy()) for datum in data]
        policy = torch.stack([(lp * w).sum() for lp, w in zip(logprobs, weights, strict=True)])
        rewards = BETA * (policy - torch.tensor(reference, dtype=policy.dtype))
        half = len(data) // 2
        margins = rewards[:half] - rewards[half:]
        loss = -F.logsigmoid(margins).mean()
        metrics = {
            "dpo_loss": float(loss.detach()),
            "accuracy": float((margins > 0).float().mean()),
            "margin": float(margins.mean()),
        }
        return loss, metrics

    return loss_fn


def preference_accuracy(policy: TrainingClient, reference: SamplingClient, dataset: Dataset) -> float:
    """The share of the first EVAL_PAIRS held-out pairs whose chosen answer gets the higher implicit reward."""
    size = min(len(dataset), EVAL_PAIRS or len(dataset))
    pairs = as_pairs([dataset[i] for i in range(size)])
    outputs = policy.forward(pairs, "cross_entropy").result().loss_fn_outputs
    policy_logps = [
        float((output["logprobs"].to_numpy() * datum.loss_fn_inputs["weights"].to_numpy()).sum())
        for output, datum in zip(outputs, pairs, strict=True)
    ]
    rewards = [BETA * (p - r) for p, r in zip(policy_logps, reference_logps(reference, pairs), strict=True)]
    metric = DPOMetric()  # ties (an untrained policy's rewards are all 0) count as wrong
    metric.accumulate(chosen_rewards=rewards[:size], rejected_rewards=rewards[size:])
    return metric.calculate()["dpo/accuracy"]


def train() -> None:
    train_set, test_set = create_dataset("train"), create_dataset("test")
    service_client = ServiceClient()
    reference = service_client.create_sampling_client(base_model=MODEL_ID).result()
    policy = service_client.create_lora_training_client(base_model=MODEL_ID, rank=LORA_RANK).result()
    print(f"held-out preference accuracy before training: {preference_accuracy(policy, reference, test_set):.3f}")

    dataloader = DataLoader(dataset=train_set, batch_size=BATCH_SIZE, shuffle=True, min_batch_size=BATCH_SIZE)
    steps = EPOCHS * len(dataloader) if MAX_STEPS <= 0 else min(MAX_STEPS, EPOCHS * len(dataloader))
    batches = itertools.islice((batch for _ in range(EPOCHS) for batch in dataloader), steps)
    losses, metrics = [], {}
    for batch in tqdm(batches, total=steps, desc="dpo"):
        pairs = as_pairs(batch)
        output = policy.forward_backward_custom(pairs, dpo_loss(reference_logps(reference, pairs))).result()
        policy.optim_step(types.AdamParams(learning_rate=LEARNING_RATE, grad_clip_norm=1.0)).result()
        metrics = output.metrics
        losses.append(metrics["dpo_loss"])
    accuracy = preference_accuracy(policy, reference, test_set)
    path = policy.save_state("dpo").result().path
    print(
        f"DPO loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}; last batch accuracy "
        f"{metrics['accuracy']:.3f}, margin {metrics['margin']:.3f}; held-out preference accuracy after "
        f"training: {accuracy:.3f}; adapter saved to {path}"
    )
    service_client.close("success").result()


if __name__ == "__main__":
    train()
