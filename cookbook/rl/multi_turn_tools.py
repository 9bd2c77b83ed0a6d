"""Agentic multi-turn GRPO: the embedded model learns to use a calculator tool, on a CPU.

    python cookbook/rl/multi_turn_tools.py

Each episode is a ``CalculatorEnv`` task ("What is 23 * 17?") with the
``calculator`` tool described in the system prompt. The model either answers
at once, or writes a ``<tool_call>``, gets the result back in a tool message
and answers in a second turn; the reward is 1.0 when the answer's last number
is the exact product. A 10M-parameter model cannot multiply in its head, but
it can copy the expression into a tool call and the result into its answer,
so the reward comes almost only through the tool.

A randomly initialised model cannot write a tool call, so a full-parameter
SFT warm-up comes first, on generated demonstrations: half call the tool,
half answer directly (with the exact product, which the model cannot
reproduce). It stops on purpose just after the model has learnt to copy
numbers (its loss falls below WARMUP_LOSS, some 250-300 steps in), when it
still calls the tool in only about half of the episodes, and is saved as a
checkpoint that the next run reuses. GRPO then trains a LoRA adapter on top:
``EnvGroup`` plays one task ``NUM_GENERATIONS`` times, ``rollout`` samples
every live episode's next turn in one batch, and the group-relative
advantages favour the episodes that used the tool, so the tool-use rate and
the reward rise together.

Every step's metrics (reward, tool-use rate, turns, sampler/trainer log-prob
mismatch) go to metrics.jsonl, both curves to curves.png. On 2 CPU cores the
whole run takes about 4 minutes, most of it the warm-up.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import deque
from typing import Any

from peft import LoraConfig
from tqdm import tqdm

import twinkle
from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams, Trajectory
from twinkle.env import CalculatorEnv, EnvGroup, Episode, rollout
from twinkle.metric import LogprobMismatchMetric
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
SEED = int(os.environ.get("SEED", 42))
WARMUP_STEPS = int(os.environ.get("WARMUP_STEPS", 500))  # at most; it stops once its loss is below WARMUP_LOSS
WARMUP_LOSS = float(os.environ.get("WARMUP_LOSS", 0.2))  # mean of the last 10 steps; ~0.6 before copying works
WARMUP_LR = float(os.environ.get("WARMUP_LR", 3e-3))
WARMUP_BATCH_SIZE = int(os.environ.get("WARMUP_BATCH_SIZE", 16))
TOOL_DEMOS = float(os.environ.get("TOOL_DEMOS", 0.5))  # share of demonstrations that call the tool
MAX_STEPS = int(os.environ.get("MAX_STEPS", 40))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 4))  # tasks per step
NUM_GENERATIONS = int(os.environ.get("NUM_GENERATIONS", 8))  # episodes per task
MICRO_BATCH_SIZE = int(os.environ.get("MICRO_BATCH_SIZE", 16))
MAX_TURNS = int(os.environ.get("MAX_TURNS", 3))
MAX_TURN_TOKENS = int(os.environ.get("MAX_TURN_TOKENS", 40))  # a tool call is ~30 tokens
LEARNING_RATE = float(os.environ.get("LR", 1e-3))  # 2e-3 can break the just-learnt copying in one step
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/multi-turn-tools")
ADAPTER_NAME = "default"
MAX_EPISODE_TOKENS = 320  # the prompt with the tool's description is ~180 tokens
# "What is 23 * 17?": every question, tool call and product has the same number of tokens, so copying a
# number is attending a fixed distance back, which a tiny model picks up within minutes.
TASK = {"low": 10, "high": 31, "operators": "*"}


def demonstration(seed: int, use_tool: bool) -> Trajectory:
    """One calculator task, solved with the tool or answered at once, ending "23 * 17 = 391" either way.

    Restating the expression makes every demonstration practise copying numbers, the skill the tool needs.
    """
    env = CalculatorEnv(**TASK)
    messages: list[Any] = list(env.reset(seed))
    if use_tool:
        call = {"name": "calculator", "arguments": {"expression": env.expression}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages += env.step(messages[-1]).messages  # the tool's result, as the environment answers it
    messages.append({"role": "assistant", "content": f"{env.expression} = {env.answer}"})
    return {"messages": messages, "tools": list(env.tools)}


def warm_up_checkpoint() -> str:
    """A full-parameter SFT checkpoint on demonstrations, trained once and reused.

    The loss sits near 0.6 until the model starts copying numbers, a few hundred steps in (when depends on
    the seed), then drops; stopping at WARMUP_LOSS catches every seed just after that point.
    """
    name = f"warmup-{WARMUP_LOSS}-loss-{WARMUP_STEPS}x{WARMUP_BATCH_SIZE}-lr{WARMUP_LR}-tools{TOOL_DEMOS}-seed{SEED}"
    directory = os.path.join(OUTPUT_DIR, name)
    marker = os.path.join(directory, "checkpoint-path")
    if os.path.exists(marker):
        with open(marker) as file:
            return file.read()
    model = TransformersModel(model_id=MODEL_ID)
    # Inputs are trajectories, encoded so that only assistant tokens are trained. enable_thinking stays True
    # (here and in the sampler): with False the generation prompt pre-fills an empty think block that the
    # template leaves out of earlier turns, and a conversation with a tool call cannot be encoded.
    model.set_template("Template")
    model.set_optimizer("AdamW", lr=WARMUP_LR)
    rng = random.Random(SEED)
    losses: deque[float] = deque(maxlen=10)
    for _ in (progress := tqdm(range(WARMUP_STEPS), desc="SFT warm-up")):
        demos = [demonstration(rng.randrange(2**31), rng.random() < TOOL_DEMOS) for _ in range(WARMUP_BATCH_SIZE)]
        model.forward_backward(inputs=demos)
        model.clip_grad_and_step()
        losses.append(model.calculate_metric(is_training=True)["loss"])
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        if len(losses) == losses.maxlen and sum(losses) / len(losses) < WARMUP_LOSS:
            break
    progress.close()
    checkpoint = model.save("last-checkpoint", output_dir=directory, save_optimizer=False)
    with open(marker, "w") as file:  # written last: a half-finished warm-up is redone
        file.write(checkpoint)
    return checkpoint


def step_metrics(episodes: list[Episode]) -> dict[str, float]:
    count = len(episodes)
    return {
        "reward/mean": sum(e.reward for e in episodes) / count,
        "tool_use_rate": sum(e.num_tool_calls > 0 for e in episodes) / count,
        "turns/mean": sum(e.num_turns for e in episodes) / count,
        "tokens/mean": sum(len(e.input_ids) for e in episodes) / count,
    }


def save_curves(logs: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(logs) + 1)
    plt.figure(figsize=(6, 3.5))
    plt.plot(steps, [log["reward/mean"] for log in logs], label="mean reward")
    plt.plot(steps, [log["tool_use_rate"] for log in logs], label="tool-use rate")
    plt.xlabel("GRPO step")
    plt.ylim(0, 1)
    plt.legend()
    plt.title("Multi-turn GRPO on CalculatorEnv")
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close()


def trainer_logps(output: Any, features: list[Any]) -> list[list[float]]:
    """The trainer's log-probs of the model's own tokens (where the feature is labelled)."""
    return [
        [lp for lp, trained in zip(logps.tolist()[: feature["length"]], feature["loss_mask"], strict=True) if trained]
        for logps, feature in zip(output.logps, features, strict=True)
    ]


def main() -> None:
    twinkle.initialize(seed=SEED)
    started = time.perf_counter()
    base_model = warm_up_checkpoint()

    model = TransformersModel(model_id=base_model)
    model.add_adapter_to_model(ADAPTER_NAME, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), seed=SEED)
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    model.set_loss("GRPOLoss", epsilon=0.2)
    sampler = TorchSampler(model_id=base_model)
    sampler.set_template("Template", model_id=base_model)
    ckpt_manager = CheckpointEngineManager(model=model, sampler=sampler)
    advantage_fn, mismatch = GRPOAdvantage(), LogprobMismatchMetric()

    logs: list[dict[str, float]] = []
    for step in (progress := tqdm(range(MAX_STEPS), desc="GRPO")):
        ckpt_manager.sync_weights(merge_and_sync=False)  # LoRA tensors only
        groups = [
            EnvGroup(CalculatorEnv, NUM_GENERATIONS, SEED * 100_000 + step * BATCH_SIZE + index, **TASK)
            for index in range(BATCH_SIZE)
        ]
        params = SamplingParams(max_tokens=MAX_TURN_TOKENS, temperature=1.0, seed=SEED + step)
        episodes = rollout(
            sampler,
            sampler.template,
            groups,
            params,
            max_turns=MAX_TURNS,
            max_tokens=MAX_EPISODE_TOKENS,
            adapter_name=ADAPTER_NAME,
        )
        rewards = [episode.reward for episode in episodes]
        advantages = advantage_fn(rewards, num_generations=NUM_GENERATIONS, scale="group").tolist()
        features = [episode.to_input_feature() for episode in episodes]
        old_logps = [episode.logprobs for episode in episodes]
        output = model.forward_backward(
            inputs=features, old_logps=old_logps, advantages=advantages, micro_batch_size=MICRO_BATCH_SIZE
        )
        mismatch.reset()
        mismatch.accumulate(sampler_logps=old_logps, trainer_logps=trainer_logps(output, features))
        model.clip_grad_and_step()
        log = {**step_metrics(episodes), **mismatch.calculate(), **model.calculate_metric(is_training=True)}
        logs.append(log)
        progress.set_postfix(reward=f"{log['reward/mean']:.2f}", tool_use=f"{log['tool_use_rate']:.2f}")

    os.makedirs(OUTPUT_DIR, exist_ok=True)
    with open(os.path.join(OUTPUT_DIR, "metrics.jsonl"), "w") as file:  # every step's metrics, a JSON line each
        file.writelines(json.dumps(log, default=float) + "\n" for log in logs)
    save_curves(logs, os.path.join(OUTPUT_DIR, "curves.png"))
    checkpoint = model.save("grpo-calculator-checkpoint", output_dir=OUTPUT_DIR)

    def mean(key: str, part: list[dict[str, float]]) -> float:
        return sum(log[key] for log in part) / len(part)

    first, last = logs[:10], logs[-10:]
    print(
        f"reward: first 10 steps {mean('reward/mean', first):.3f} -> last 10 steps {mean('reward/mean', last):.3f}; "
        f"tool-use rate: first 10 {mean('tool_use_rate', first):.3f} -> last 10 {mean('tool_use_rate', last):.3f} "
        f"({time.perf_counter() - started:.0f} s incl. warm-up); sampler/trainer logprob mismatch max "
        f"{max(log['logprob_mismatch/max_abs'] for log in logs):.2e}; adapter saved to {checkpoint}"
    )
    print(f"last episode: {episodes[-1].messages}")


if __name__ == "__main__":
    main()
