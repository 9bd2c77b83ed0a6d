"""The GRPO cookbook, run by a Twinkle server: cookbook/rl/grpo.py with ``twinkle_client`` imports and
one ``init_twinkle_client`` call; the code is otherwise unchanged. Sampling, training and the weight
sync happen on the server; rewards, advantages and metrics are computed here (they need no torch).

Start a server (it serves the embedded default model) and create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/grpo.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. MODEL_ID must name the server's base model.

As in-process, the SFT warm-up trains all weights (a full-parameter run, with its own copy of the
model on the server) and GRPO trains a LoRA adapter on the warm-up checkpoint, which stays in the
server's checkpoint store; the ``checkpoint-path`` marker written here holds its ``twinkle://`` path
for the next run. (A LoRA warm-up is no substitute: on the randomly initialised tiny model its loss
is still 6.6-7.9 after 120 steps, against 3.0 after 60 for full fine-tuning, and no completion
earns a reward.)
"""

import os
import time

from tqdm import tqdm

import twinkle
from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.advantage import GRPOAdvantage
from twinkle_client.checkpoint_engine import CheckpointEngineManager
from twinkle_client.data_format import SamplingParams
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.metric import CompletionRewardMetric, LogprobMismatchMetric
from twinkle_client.model import TransformersModel
from twinkle_client.preprocessor import GSM8KProcessor
from twinkle_client.reward import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle_client.sampler import TorchSampler

BASE_URL = os.environ.get("TWINKLE_BASE_URL", "http://127.0.0.1:8000")
API_KEY = os.environ.get("TWINKLE_API_KEY")
MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
SEED = int(os.environ.get("SEED", 42))
WARMUP_STEPS = int(os.environ.get("WARMUP_STEPS", 60))
WARMUP_LR = float(os.environ.get("WARMUP_LR", 1e-3))
MAX_STEPS = int(os.environ.get("MAX_STEPS", 60))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))  # prompts per step
NUM_GENERATIONS = int(os.environ.get("NUM_GENERATIONS", 8))
MINI_BATCH_SIZE = int(os.environ.get("MINI_BATCH_SIZE", 64))  # completions per optimizer step
MICRO_BATCH_SIZE = int(os.environ.get("MICRO_BATCH_SIZE", 32))
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", 48))
LEARNING_RATE = float(os.environ.get("LR", 5e-4))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/grpo")
ADAPTER_NAME = "default"


def create_dataset(for_sampling: bool) -> Dataset:
    """Prompts to sample from (RL), or prompts with worked solutions (warm-up).

    No system prompt: the tiny model cannot follow instructions anyway, and
    shorter prompts make every step cheaper.
    """
    dataset = Dataset(DatasetMeta("builtin://gsm8k-mini"))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256, enable_thinking=False)
    dataset.map(GSM8KProcessor(system=None, include_solution=not for_sampling))
    dataset.encode(add_generation_prompt=for_sampling)
    return dataset


def warm_up_checkpoint() -> str:
    """A full-parameter SFT checkpoint on worked solutions, trained once and reused."""
    directory = os.path.join(OUTPUT_DIR, f"warmup-{WARMUP_STEPS}-steps")
    marker = os.path.join(directory, "checkpoint-path")
    if os.path.exists(marker):
        with open(marker) as file:
            return file.read()
    model = TransformersModel(model_id=MODEL_ID)
    model.set_optimizer("AdamW", lr=WARMUP_LR)
    dataloader = DataLoader(dataset=create_dataset(for_sampling=False), batch_size=16, shuffle=True, seed=SEED)
    batches = iter(dataloader)
    for _ in tqdm(range(WARMUP_STEPS), desc="SFT warm-up"):
        model.forward_backward(inputs=next(batches))
        model.clip_grad_and_step()
    checkpoint = model.save("last-checkpoint", output_dir=directory, save_optimizer=False)
    os.makedirs(directory, exist_ok=True)  # remotely the checkpoint stays on the server; only its marker is here
    with open(marker, "w") as file:  # written last: a half-finished warm-up is redone
        file.write(checkpoint)
    return checkpoint


def compute_rewards(trajectories: list) -> tuple[list[float], list[float], list[float]]:
    accuracy = GSM8KAccuracyReward()(trajectories)
    format_ = GSM8KFormatReward()(trajectories)
    total = [(a + f) / 2 for a, f in zip(accuracy, format_, strict=True)]
    return total, format_, accuracy


def save_reward_curve(rewards: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure(figsize=(6, 3.5))
    plt.plot(range(1, len(rewards) + 1), rewards)
    plt.xlabel("GRPO step")
    plt.ylabel("mean reward")
    plt.ylim(0, 1)
    plt.title("GRPO on gsm8k-mini")
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close()


def main() -> None:
    init_twinkle_client(BASE_URL, API_KEY)
    twinkle.initialize(seed=SEED)
    started = time.perf_counter()
    base_model = warm_up_checkpoint()

    model = TransformersModel(model_id=base_model)
    model.add_adapter_to_model(ADAPTER_NAME, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    model.set_loss("GRPOLoss", epsilon=0.2)
    sampler = TorchSampler(model_id=base_model)
    sampler.set_template("Template", model_id=base_model, enable_thinking=False)
    ckpt_manager = CheckpointEngineManager(model=model, sampler=sampler)
    dataloader = DataLoader(dataset=create_dataset(for_sampling=True), batch_size=BATCH_SIZE, shuffle=True, seed=SEED)
    advantage_fn = GRPOAdvantage()
    metrics, mismatch = CompletionRewardMetric(), LogprobMismatchMetric()
    reward_curve: list[float] = []
    progress = tqdm(total=MAX_STEPS, desc="GRPO")
    batches = iter(dataloader)
    while len(reward_curve) < MAX_STEPS:
        prompts = next(batches)
        ckpt_manager.sync_weights(merge_and_sync=False)  # LoRA tensors only
        sampling_params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=SEED + len(reward_curve))
        response = sampler.sample(prompts, sampling_params, adapter_name=ADAPTER_NAME, num_samples=NUM_GENERATIONS)
        inputs = [sequence.new_input_feature for sequence in response.sequences]
        old_logps = [sequence.logprobs for sequence in response.sequences]
        total, format_, accuracy = compute_rewards(inputs)
        metrics.reset()
        metrics.accumulate(
            completion_lengths=[len(s.tokens) for s in response.sequences],
            rewards={"total": total, "format": format_, "accuracy": accuracy},
        )
        # num_samples=NUM_GENERATIONS keeps each prompt's completions together (contiguous groups).
        advantages = advantage_fn(total, num_generations=NUM_GENERATIONS, scale="group").tolist()
        for start in range(0, len(inputs), MINI_BATCH_SIZE):
            end = start + MINI_BATCH_SIZE
            output = model.forward_backward(
                inputs=inputs[start:end],
                old_logps=old_logps[start:end],
                advantages=advantages[start:end],
                micro_batch_size=MICRO_BATCH_SIZE,
            )
            mismatch.accumulate(
                sampler_logps=old_logps[start:end], trainer_logps=_completion_logps(output, inputs[start:end])
            )
            model.clip_grad_and_step()
        log = {**metrics.calculate(), **mismatch.calculate(), **model.calculate_metric(is_training=True)}
        mismatch.reset()
        reward_curve.append(log["reward/total/mean"])
        progress.update()
        progress.set_postfix(
            reward=f"{log['reward/total/mean']:.2f}",
            format=f"{log['reward/format/mean']:.2f}",
            accuracy=f"{log['reward/accuracy/mean']:.2f}",
        )
    progress.close()

    os.makedirs(OUTPUT_DIR, exist_ok=True)
    save_reward_curve(reward_curve, os.path.join(OUTPUT_DIR, "reward.png"))
    checkpoint = model.save("grpo-gsm8k-checkpoint", output_dir=OUTPUT_DIR)
    first, last = reward_curve[:10], reward_curve[-10:]
    print(
        f"mean reward: first 10 steps {sum(first) / len(first):.3f} -> last 10 steps {sum(last) / len(last):.3f} "
        f"({time.perf_counter() - started:.0f} s incl. warm-up); sampler/trainer logprob mismatch max "
        f"{log['logprob_mismatch/max_abs']:.2e}; adapter saved to {checkpoint}"
    )
    print(f"last completion: {response.sequences[-1].decoded!r}")


def _completion_logps(output, inputs) -> list[list[float]]:
    """The trainer's log-probs of the completion tokens (where the feature is labelled)."""
    return [
        [lp for lp, mask in zip(logps.tolist(), feature["loss_mask"], strict=True) if mask]
        for logps, feature in zip(output.logps, inputs, strict=True)
    ]


if __name__ == "__main__":
    main()
