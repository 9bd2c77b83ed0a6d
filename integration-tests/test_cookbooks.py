"""The cookbook recipes run end to end as a user runs them (shrunk through their environment knobs).

``rl/dpo.py`` runs in ``test_torchrun_dpo.py``, in one process and under torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

RECIPES = {
    "sft/self_cognition.py": ({"EPOCHS": "1", "BATCH_SIZE": "16"}, r"loss: first step", "loss.png"),
    "rl/grpo.py": (
        {"WARMUP_STEPS": "2", "MAX_STEPS": "2", "BATCH_SIZE": "2", "NUM_GENERATIONS": "2", "MAX_NEW_TOKENS": "4"},
        r"mean reward: first 10 steps",
        "reward.png",
    ),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_runs_and_writes_its_outputs(recipe, tmp_path):
    knobs, expected, figure = RECIPES[recipe]
    env = {**os.environ, **knobs, "OUTPUT_DIR": str(tmp_path), "MPLBACKEND": "Agg"}
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "cookbook" / recipe)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert expected in completed.stdout, completed.stdout[-2000:]
    if figure:
        assert (tmp_path / figure).stat().st_size > 0
