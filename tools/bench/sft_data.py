"""Realistic chat SFT batches for the benchmarks: multi-turn conversations from the embedded data sets.

Turns are identity questions (``builtin://self-cognition``, short) and math
problems with worked solutions (``builtin://gsm8k-mini``, longer), shuffled
together and encoded by ``twinkle.template.Template`` with labels only on
assistant tokens. Everything is seeded, so every run sees the same batches.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from twinkle.data_format import InputFeature, Message
from twinkle.hub import resolve_dataset
from twinkle.preprocessor import GSM8KProcessor, SelfCognitionProcessor
from twinkle.template import Template

SEED = 0

Batch = list[InputFeature]


def chat_turns(seed: int) -> Iterator[list[Message]]:
    """Endless shuffled user/assistant exchanges: identity questions (short) and math with solutions (longer)."""
    identity = SelfCognitionProcessor("Twinkle", "ModelScope")
    math = GSM8KProcessor(system=None, include_solution=True)
    turns = [identity(row)["messages"] for row in _jsonl(resolve_dataset("builtin://self-cognition"))]
    turns += [math(row)["messages"] for row in _jsonl(resolve_dataset("builtin://gsm8k-mini"))]
    rng = random.Random(seed)
    while True:
        rng.shuffle(turns)
        yield from turns


def _jsonl(directory: str) -> list[dict[str, Any]]:
    with open(Path(directory) / "train.jsonl", encoding="utf-8") as file:
        return [json.loads(line) for line in file]


def fixed_length_batches(template: Template, length: int, batch_size: int, count: int) -> list[Batch]:
    """Conversations grown past ``length`` tokens, then cut to exactly ``length`` (no padding anywhere)."""
    cutter = Template(tokenizer=template.tokenizer, max_length=length, truncation_strategy="right")
    turns = chat_turns(SEED)
    features = []
    for _ in range(batch_size * count):
        messages = next(turns)
        while _num_tokens(template, messages) < length:
            messages = messages + next(turns)
        features.append(cutter.encode({"messages": messages}))
    return _batched(features, batch_size)


def variable_length_batches(
    template: Template, min_length: int, max_length: int, batch_size: int, count: int
) -> list[Batch]:
    """Whole conversations of widely spread lengths, none longer than ``max_length``.

    Each sample draws a target length uniformly from ``[min_length, max_length]``,
    then takes turns while the conversation still fits in it. The first turn is
    always taken, so very short targets become one short identity exchange.
    """
    rng = random.Random(SEED)
    turns = chat_turns(SEED + 1)
    features = []
    for _ in range(batch_size * count):
        target = rng.randint(min_length, max_length)
        messages = next(turns)
        while _num_tokens(template, candidate := messages + next(turns)) <= target:
            messages = candidate
        features.append(template.encode({"messages": messages}))
    return _batched(features, batch_size)


def _num_tokens(template: Template, messages: list[Message]) -> int:
    return len(template.encode({"messages": messages})["input_ids"])


def _batched(features: list[InputFeature], batch_size: int) -> list[Batch]:
    return [features[i : i + batch_size] for i in range(0, len(features), batch_size)]


def label_everything(batches: list[Batch]) -> None:
    """Train on every token, prompts included: Twinkle's worst case, with no prompt positions to skip."""
    for feature in itertools.chain.from_iterable(batches):
        feature["labels"] = list(feature["input_ids"])
        feature["loss_mask"] = [1] * len(feature["input_ids"])


def real_tokens(batch: Batch) -> int:
    return sum(len(feature["input_ids"]) for feature in batch)
