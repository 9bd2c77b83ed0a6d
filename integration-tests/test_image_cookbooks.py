"""The vision-language cookbooks (cookbook/mm/), shrunk through their knobs: SFT accuracy and image GRPO.

Kept apart from test_cookbooks.py so the two slow files can run on different test workers.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
from cookbook_runs import run_cookbook


@pytest.mark.slow
@pytest.mark.integration
def test_vision_language_sft_answers_held_out_image_questions_better_than_without_the_image(tmp_path):
    completed = run_cookbook("mm/clevr_sft.py", tmp_path, {"EPOCHS": "4"})
    loss = re.search(r"^training loss: first step (\S+) -> last epoch (\S+)$", completed.stdout, re.M)
    accuracy = re.search(
        r"^held-out answer accuracy: (\S+) before -> (\S+) after; baselines without the image: majority answer "
        r"(\S+), majority answer per question type (\S+) ",
        completed.stdout,
        re.M,
    )
    assert loss and accuracy, completed.stdout[-2000:]
    assert float(loss[2]) < float(loss[1]) / 5
    after, majority, per_type = float(accuracy[2]), float(accuracy[3]), float(accuracy[4])
    assert (majority, per_type) == (0.175, 0.315)  # fixed by the embedded data set
    assert after > per_type + 0.1, completed.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.integration
def test_image_grpo_trains_a_vision_tower_adapter_on_the_samplers_logprobs(tmp_path):
    knobs = {"WARMUP_STEPS": "3", "MAX_STEPS": "2", "BATCH_SIZE": "4", "NUM_GENERATIONS": "4", "DATA_ROWS": "64"}
    completed = run_cookbook("mm/clevr_grpo.py", tmp_path, {**knobs, "MINI_BATCH_SIZE": "16", "MAX_NEW_TOKENS": "3"})
    logs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(logs) == 2
    for log in logs:
        assert log["reward/total/mean"] == log["reward/accuracy/mean"] and 0.0 <= log["reward/total/mean"] <= 1.0
        assert log["logprob_mismatch/num_tokens"] > 0 and log["logprob_mismatch/max_abs"] <= 1e-4
    assert re.search(r"^mean reward: first 10 steps \S+ -> last 10 steps \S+ ", completed.stdout, re.M)
    with safe_open(tmp_path / "grpo-clevr-checkpoint" / "adapter_model.safetensors", "pt") as adapter:
        assert any(".visual." in key for key in adapter.keys())  # noqa: SIM118  # the vision tower's adapter trained and was served
