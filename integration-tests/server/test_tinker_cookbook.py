"""Two unmodified tinker-cookbook 0.6.1 recipes train against a real ``twinkle server`` (the README's commands).

``chat_sl`` fine-tunes on the cookbook's bundled conversations and must lower
its loss; ``math_rl`` (``env=arithmetic``) samples, scores and trains, then
resumes from its last checkpoint. Both only get the server's URL, a ``tml-``
key and the local folder of the embedded model (its tokenizer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest
import tinker_cookbook

from twinkle.hub import resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from sdk_process import module_command

pytestmark = pytest.mark.integration

BUNDLED_CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["alice"])


def run_recipe(server, module: str, log_path: Path, *args: str) -> list[dict]:
    """``python -m <module> key=value ...`` as a user runs it; returns the metrics rows it logged."""
    env = {
        **os.environ,
        "TINKER_API_KEY": server.keys["alice"],
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        # The cookbook fetches a price list from the internet at start; fail that at once, not after a DNS wait.
        "https_proxy": "http://127.0.0.1:9",
        "no_proxy": "127.0.0.1,localhost",
    }
    command = module_command(  # python -m module ..., without the interpreter's racy finalization (sdk_process)
        module,
        f"base_url={server.url}",
        f"model_name={resolve_model()}",
        "renderer_name=role_colon",
        f"log_path={log_path}",
        "eval_every=0",
        *args,
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Training completed successfully" in done.stdout + done.stderr
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]


def test_chat_sl_on_the_bundled_conversations_lowers_the_loss(server, tmp_path):
    rows = run_recipe(
        server,
        "tinker_cookbook.recipes.chat_sl.train",
        tmp_path / "sl",
        f"dataset={BUNDLED_CONVERSATIONS}",
        "batch_size=8",
        "max_length=256",
        "lora_rank=16",
        "learning_rate=3e-3",
        "num_epochs=1",
        "save_every=8",
        "infrequent_eval_every=0",
        "behavior_if_log_dir_exists=delete",
    )
    losses = [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]
    assert len(losses) == 16  # 128 conversations, 8 per step
    assert mean(losses[-3:]) < mean(losses[:3]) - 2.0, losses
    saved = checkpoints(tmp_path / "sl")
    assert [c["name"] for c in saved] == ["000008", "final"]
    assert saved[-1]["state_path"].endswith("/weights/final")
    assert saved[-1]["sampler_path"].endswith("/sampler_weights/final")


def test_math_rl_arithmetic_samples_trains_and_resumes(server, tmp_path):
    log_path = tmp_path / "rl"
    common = (
        "env=arithmetic",
        "groups_per_batch=2",
        "group_size=2",
        "max_tokens=3",
        "lora_rank=8",
        "learning_rate=1e-4",
        "loss_fn=importance_sampling",
        "save_every=2",
    )
    module = "tinker_cookbook.recipes.math_rl.train"
    rows = run_recipe(server, module, log_path, *common, "max_steps=3", "behavior_if_log_dir_exists=delete")
    assert sum(row.get("tokens/sampled", 0) for row in rows) > 0
    assert [c["name"] for c in checkpoints(log_path)] == ["000002", "final"]
    # Resuming reads the run back by its tinker:// path and reloads weights and optimizer state.
    rows = run_recipe(server, module, log_path, *common, "max_steps=5", "behavior_if_log_dir_exists=resume")
    assert max(row["step"] for row in rows) >= 4
