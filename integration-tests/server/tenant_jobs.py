"""The four tenants' jobs: shared by the client worker processes and the in-process reference."""

from __future__ import annotations

import random

from twinkle.data_format import IGNORE_INDEX, make_input_feature

STEPS = 3
JOBS = {
    "sft-r8": {"kind": "sft", "lora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}, "lr": 1e-2},
    "sft-r32": {"kind": "sft", "lora": {"r": 32, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}, "lr": 5e-3},
    "grpo": {"kind": "grpo", "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]}, "lr": 1e-2},
    "logps": {"kind": "forward", "lora": {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj"]}, "lr": 1e-3},
}


def job_features(job: str, step: int) -> list[dict]:
    """Each job's own batch for ``step``: GRPO gets prompts only, the others labelled sequences."""
    rng = random.Random(f"{job}-{step}")
    features = []
    for _ in range(2 if job == "grpo" else 3):
        ids = [rng.randrange(100, 5000) for _ in range(rng.randrange(6, 14))]
        if job == "grpo":
            features.append({"input_ids": ids})
        else:
            features.append(make_input_feature(ids, [IGNORE_INDEX] * 3 + ids[3:]))
    return features


def grpo_rewards(completions: list[list[int]]) -> list[float]:
    """A verifiable toy reward, group-normalised over each prompt's two samples: the share of even token ids."""
    rewards = [sum(token % 2 == 0 for token in tokens) / len(tokens) for tokens in completions]
    advantages = []
    for first in range(0, len(rewards), 2):
        pair = rewards[first : first + 2]
        mean = sum(pair) / 2
        advantages.extend(reward - mean for reward in pair)
    return advantages
