"""GRPO on the embedded default model with verifiable GSM8K-style rewards, on a CPU.

The seed's GRPO listing (dataset -> sampler -> rewards -> advantages ->
mini-batched ``forward_backward(old_logps=..., advantages=...)`` ->
``clip_grad_and_step`` -> ``sync_weights``), in one process. A random tiny
model cannot do arithmetic, so a short supervised warm-up on worked solutions
comes first; GRPO then improves the answers' format and accuracy:

    python cookbook/rl/grpo.py

The reward per completion is the mean of GSM8KFormatReward and
GSM8KAccuracyReward (so it lies in [0, 1]); its curve is saved as a PNG.
"""

import os
import time

from peft import LoraConfig
from tqdm import tqdm

import twinkle
from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import CompletionRewardMetric, LogprobMismatchMetric
from twinkle.model import TransformersModel
from twinkle.preprocessor import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.sampler import TorchSampler

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
SEED = int(os.environ.get("SEED", 42))
WARMUP_STEPS = int(os.environ.get("WARMUP_STEPS", 60))
MAX_STEPS = int(os.environ.get("MAX_STEPS", 60))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))  # prompts per step
NUM_GENERATIONS = int(os.environ.get("NUM_GENERATIONS", 8))
MINI_BATCH_SIZE = int(os.environ.get("MINI_BATCH_SIZE", 64))  # completions per optimizer step
MICRO_BATCH_SIZE = int(os.environ.get("MICRO_BATCH_SIZE", 32))
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", 40))
LEARNING_RATE = float(os.environ.get("LR", 5e-3))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/grpo")
ADAPTER_NAME = "default"


def create_dataset(for_sampling: bool) -> Dataset:
    """Prompts to sample from (RL), or prompts with worked solutions (warm-up)."""
    dataset = Dataset(DatasetMeta("builtin://gsm8k-mini"))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256, enable_thinking=False)
    dataset.map(GSM8KProcessor(include_solution=not for_sampling))
    dataset.encode(add_generation_prompt=for_sampling)
    return dataset


def warm_up(model: TransformersModel, steps: int) -> None:
    """A little supervised learning on worked solutions, so sampled answers can be right at all."""
    dataloader = DataLoader(dataset=create_dataset(for_sampling=False), batch_size=16, shuffle=True, seed=SEED)
    batches = iter(dataloader)
    for _ in tqdm(range(steps), desc="warm-up"):
        model.forward_backward(inputs=next(batches))
        model.clip_grad_and_step()


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
    twinkle.initialize(seed=SEED)
    model = TransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model(ADAPTER_NAME, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    warm_up(model, WARMUP_STEPS)

    model.set_optimizer("AdamW", lr=LEARNING_RATE)  # a fresh optimizer for the RL phase
    model.set_loss("GRPOLoss", epsilon=0.2)
    sampler = TorchSampler(model_id=MODEL_ID)
    sampler.set_template("Template", model_id=MODEL_ID, enable_thinking=False)
    ckpt_manager = CheckpointEngineManager(model=model, sampler=sampler)
    dataloader = DataLoader(dataset=create_dataset(for_sampling=True), batch_size=BATCH_SIZE, shuffle=True, seed=SEED)
    advantage_fn = GRPOAdvantage()
    metrics, mismatch = CompletionRewardMetric(), LogprobMismatchMetric()
    sampling_params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=SEED)
    reward_curve: list[float] = []
    started = time.perf_counter()
    progress = tqdm(total=MAX_STEPS, desc="grpo")
    batches = iter(dataloader)
    while len(reward_curve) < MAX_STEPS:
        prompts = next(batches)
        ckpt_manager.sync_weights(merge_and_sync=False)
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
        progress.set_postfix(reward=f"{log['reward/total/mean']:.2f}", acc=f"{log['reward/accuracy/mean']:.2f}")
    progress.close()

    os.makedirs(OUTPUT_DIR, exist_ok=True)
    save_reward_curve(reward_curve, os.path.join(OUTPUT_DIR, "reward.png"))
    checkpoint = model.save("grpo-gsm8k-checkpoint", output_dir=OUTPUT_DIR)
    first, last = reward_curve[:10], reward_curve[-10:]
    print(
        f"mean reward: first 10 steps {sum(first) / len(first):.3f} -> last 10 steps {sum(last) / len(last):.3f} "
        f"({time.perf_counter() - started:.0f} s); sampler/trainer logprob mismatch max "
        f"{log.get('logprob_mismatch/max_abs', float('nan')):.2e}; adapter saved to {checkpoint}"
    )


def _completion_logps(output, inputs) -> list[list[float]]:
    """The trainer's log-probs of the completion tokens (where the feature is labelled)."""
    return [
        [lp for lp, mask in zip(logps.tolist(), feature["loss_mask"], strict=True) if mask]
        for logps, feature in zip(output.logps, inputs, strict=True)
    ]


if __name__ == "__main__":
    main()
