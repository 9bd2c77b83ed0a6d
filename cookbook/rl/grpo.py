"""GRPO on the embedded default model with verifiable GSM8K-style rewards, on a CPU.

The seed's GRPO listing (dataset -> sampler -> rewards -> advantages ->
mini-batched ``forward_backward(old_logps=..., advantages=...)`` ->
``clip_grad_and_step`` -> ``sync_weights``), in one process:

    python cookbook/rl/grpo.py

A randomly initialised tiny model cannot write anything sensible, so a short
full-parameter SFT warm-up on worked solutions comes first and is saved as a
checkpoint (reused on the next run). It stops early on purpose: the model has
seen the answer format but rarely produces it. GRPO then trains a LoRA adapter
on top of that checkpoint. The reward per completion is the mean of
GSM8KFormatReward and GSM8KAccuracyReward (so it lies in [0, 1]); its curve is
saved as a PNG, every step's metrics to metrics.jsonl. On 2 CPU cores the whole
run takes about 4 minutes. cookbook/rl/grpo_ray.py runs this recipe with the
model and the sampler as Ray actors.

The recipe builds its parts from the classes in a ``Components``: twinkle's here,
twinkle_client's in cookbook/client/twinkle/self_host/short_math_grpo.py, which
runs this same ``main`` on a Twinkle server. What it learns is a ``Task`` (data,
preprocessor, rewards): GSM8K here, image questions in cookbook/mm/clevr_grpo.py.

``SAMPLER=vllm`` samples with ``vLLMSampler`` (extra ``twinkle-sampler[vllm]``;
``make test-vllm``'s venv has the CPU build). vLLM's CPU attention runs no
heads smaller than 32, so on the default model the recipe then uses the
embedded tiny Qwen3 built with ``head_dim=32`` (same tokenizer and data).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

import twinkle
from twinkle.advantage import GRPOAdvantage
from twinkle.data_format import SamplingParams
from twinkle.metric import CompletionRewardMetric, LogprobMismatchMetric
from twinkle.preprocessor import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward

if TYPE_CHECKING:
    from twinkle.dataset import Dataset
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
SAMPLER = os.environ.get("SAMPLER", "torch")  # "torch" (TorchSampler) or "vllm" (vLLMSampler)
if SAMPLER == "vllm":  # the engine in the sampler's process; set before Ray starts, so its actors see it too
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
DATA_ROWS = int(os.environ["DATA_ROWS"]) if "DATA_ROWS" in os.environ else None  # the first rows only (None: all)
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/grpo")
ADAPTER_NAME = "default"


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
    TorchSampler: Any
    CheckpointEngineManager: Any


def local_components() -> Components:
    """Training and sampling in this process (or as Ray actors, by ``remote_group=``)."""
    from peft import LoraConfig

    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    return Components(
        LoraConfig, Dataset, DatasetMeta, DataLoader, TransformersModel, TorchSampler, CheckpointEngineManager
    )


@dataclass(frozen=True)
class Task:
    """What the recipe learns: a data set, its preprocessor and the rewards (the total is their mean)."""

    name: str
    data_id: str
    preprocessor: Callable[[bool], Any]  # for_sampling -> a preprocessor: prompts only, or with solutions
    rewards: dict[str, Any]  # reward name -> a completion reward (a callable over trajectories)


# No system prompt: the tiny model cannot follow instructions anyway, and shorter prompts make every step cheaper.
GSM8K = Task(
    "gsm8k",
    "builtin://gsm8k-mini",
    lambda for_sampling: GSM8KProcessor(system=None, include_solution=not for_sampling),
    {"format": GSM8KFormatReward(), "accuracy": GSM8KAccuracyReward()},
)


def create_dataset(components: Components, for_sampling: bool, task: Task = GSM8K) -> Dataset:
    """Prompts to sample from (RL), or prompts with worked solutions (warm-up)."""
    rows = range(DATA_ROWS) if DATA_ROWS is not None else None
    dataset = components.Dataset(components.DatasetMeta(task.data_id, data_slice=rows))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256, enable_thinking=False)
    dataset.map(task.preprocessor(for_sampling))
    dataset.encode(add_generation_prompt=for_sampling)
    return dataset


def warm_up_checkpoint(components: Components, task: Task = GSM8K, **placement: Any) -> str:
    """A full-parameter SFT checkpoint on worked solutions, trained once and reused.

    ``placement`` (``remote_group=``, ``device_mesh=``) puts the model on a device group in Ray mode.
    """
    model_id = initial_model()
    suffix = "" if model_id == MODEL_ID else "-head32"
    directory = os.path.join(OUTPUT_DIR, f"warmup-{WARMUP_STEPS}-steps{suffix}")
    marker = os.path.join(directory, "checkpoint-path")
    if os.path.exists(marker):
        with open(marker) as file:
            return file.read()
    model = components.TransformersModel(model_id=model_id, **placement)
    model.set_optimizer("AdamW", lr=WARMUP_LR)
    warm_up_data = create_dataset(components, for_sampling=False, task=task)
    dataloader = components.DataLoader(dataset=warm_up_data, batch_size=16, shuffle=True, seed=SEED)
    batches = endless(dataloader)
    for _ in tqdm(range(WARMUP_STEPS), desc="SFT warm-up"):
        model.forward_backward(inputs=next(batches))
        model.clip_grad_and_step()
    checkpoint = model.save("last-checkpoint", output_dir=directory, save_optimizer=False)
    os.makedirs(directory, exist_ok=True)  # remotely the checkpoint stays on the server; only its marker is here
    with open(marker, "w") as file:  # written last: a half-finished warm-up is redone
        file.write(checkpoint)
    return checkpoint


def endless(dataloader: Any) -> Iterator[Any]:
    """The dataloader's batches, epoch after epoch."""
    while True:
        yield from dataloader


def initial_model() -> str:
    """MODEL_ID; for vLLM on the default model, its build with heads 32 wide (vLLM's CPU attention minimum)."""
    if SAMPLER == "vllm" and MODEL_ID == "builtin://qwen3-tiny":
        return "builtin://qwen3-tiny-head32"
    return MODEL_ID


def compute_rewards(trajectories: list, task: Task = GSM8K) -> dict[str, list[float]]:
    """Every reward of ``task`` per trajectory, and their mean as ``total``."""
    parts = {name: reward(trajectories) for name, reward in task.rewards.items()}
    total = [sum(values) / len(values) for values in zip(*parts.values(), strict=True)]
    return {"total": total, **parts}


def save_reward_curve(rewards: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure(figsize=(6, 3.5))
    plt.plot(range(1, len(rewards) + 1), rewards)
    plt.xlabel("GRPO step")
    plt.ylabel("mean reward")
    plt.ylim(0, 1)
    plt.title(title)
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close()


def build_model(components: Components, base_model: str, **placement: Any) -> TransformersModel:
    """The policy: a LoRA adapter on the warm-up checkpoint, initialised from SEED (cached warm-up or not)."""
    model = components.TransformersModel(model_id=base_model, **placement)
    lora = components.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    model.add_adapter_to_model(ADAPTER_NAME, lora, seed=SEED)
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    model.set_loss("GRPOLoss", epsilon=0.2)
    return model


def build_sampler(components: Components, base_model: str, **placement: Any) -> TorchSampler:
    if SAMPLER == "vllm":  # in-process engine, fp32 (log-probs equal the trainer's), one slot beside the policy's
        from twinkle.sampler import vLLMSampler

        engine_args = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "enable_lora": True}
        engine_args.update(max_lora_rank=16, max_loras=2)
        sampler = vLLMSampler(model_id=base_model, engine_args=engine_args, **placement)
    else:
        sampler = components.TorchSampler(model_id=base_model, **placement)
    sampler.set_template("Template", model_id=base_model, enable_thinking=False)
    return sampler


def train(
    components: Components, model: TransformersModel, sampler: TorchSampler, started: float, task: Task = GSM8K
) -> None:
    """The GRPO loop and its report: the same code whether model and sampler run here, as Ray actors or on a server."""
    ckpt_manager = components.CheckpointEngineManager(model=model, sampler=sampler)
    prompts_data = create_dataset(components, for_sampling=True, task=task)
    dataloader = components.DataLoader(dataset=prompts_data, batch_size=BATCH_SIZE, shuffle=True, seed=SEED)
    advantage_fn = GRPOAdvantage()
    metrics, mismatch = CompletionRewardMetric(), LogprobMismatchMetric()
    reward_curve: list[float] = []
    step_logs: list[dict] = []
    progress = tqdm(total=MAX_STEPS, desc="GRPO")
    batches = endless(dataloader)
    while len(reward_curve) < MAX_STEPS:
        prompts = next(batches)
        ckpt_manager.sync_weights(merge_and_sync=False)  # LoRA tensors only
        sampling_params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=SEED + len(reward_curve))
        response = sampler.sample(prompts, sampling_params, adapter_name=ADAPTER_NAME, num_samples=NUM_GENERATIONS)
        inputs = [sequence.new_input_feature for sequence in response.sequences]
        old_logps = [sequence.logprobs for sequence in response.sequences]
        rewards = compute_rewards(inputs, task)
        metrics.reset()
        metrics.accumulate(completion_lengths=[len(s.tokens) for s in response.sequences], rewards=rewards)
        # num_samples=NUM_GENERATIONS keeps each prompt's completions together (contiguous groups).
        advantages = advantage_fn(rewards["total"], num_generations=NUM_GENERATIONS, scale="group").tolist()
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
        step_logs.append(log)
        progress.update()
        progress.set_postfix({name: f"{log[f'reward/{name}/mean']:.2f}" for name in rewards})
    progress.close()

    os.makedirs(OUTPUT_DIR, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR, "metrics.jsonl"), "w") as file:  # every step's metrics, a JSON line each
        file.writelines(json.dumps(log, default=float) + "\n" for log in step_logs)
    save_reward_curve(reward_curve, os.path.join(OUTPUT_DIR, "reward.png"), f"GRPO on {task.data_id}")
    checkpoint = model.save(f"grpo-{task.name}-checkpoint", output_dir=OUTPUT_DIR)
    first, last = reward_curve[:10], reward_curve[-10:]
    print(
        f"mean reward: first 10 steps {sum(first) / len(first):.3f} -> last 10 steps {sum(last) / len(last):.3f} "
        f"({time.perf_counter() - started:.0f} s incl. warm-up); sampler/trainer logprob mismatch max "
        f"{log['logprob_mismatch/max_abs']:.2e}; adapter saved to {checkpoint}"
    )
    print(f"last completion: {response.sequences[-1].decoded!r}")


def main(components: Components, task: Task = GSM8K) -> None:
    twinkle.initialize(seed=SEED)
    started = time.perf_counter()
    base_model = warm_up_checkpoint(components, task)
    train(components, build_model(components, base_model), build_sampler(components, base_model), started, task)


def _completion_logps(output, inputs) -> list[list[float]]:
    """The trainer's log-probs of the completion tokens (where the feature is labelled)."""
    return [
        [lp for lp, mask in zip(logps.tolist(), feature["loss_mask"], strict=True) if mask]
        for logps, feature in zip(output.logps, inputs, strict=True)
    ]


if __name__ == "__main__":
    main(local_components())
