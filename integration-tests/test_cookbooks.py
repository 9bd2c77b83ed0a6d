"""Every cookbook runs in CI as a user runs it, shrunk through its environment knobs, and is checked on what it prints.

Each script runs once, in the test that checks it most (``COVERED_BY``); this module runs the ones no
other test needs.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cookbook_runs import COOKBOOK, run_cookbook

REPO_ROOT = Path(__file__).resolve().parents[1]

COVERED_BY = {
    "sft/self_cognition.py": "integration-tests/test_torchrun_sft.py",  # one process, then DDP and FSDP2
    "sft/full.py": "integration-tests/test_cookbooks.py",
    "sft/sequence_parallel.py": "integration-tests/test_torchrun_sequence_parallel.py",  # one process vs Ulysses
    "sft/moe.py": "integration-tests/test_torchrun_moe.py",  # one process vs FSDP2
    "sft/expert_parallel.py": "integration-tests/test_torchrun_moe.py",  # one process vs EP + SP over FSDP2
    "rl/dpo.py": "integration-tests/test_torchrun_dpo.py",  # one process, then DDP and FSDP2
    "rl/grpo.py": "integration-tests/test_ray_grpo.py",  # in one process, against the Ray run
    "rl/grpo_ray.py": "integration-tests/test_ray_grpo.py",
    "rl/multi_turn_tools.py": "integration-tests/test_cookbooks.py",
    "mm/clevr_sft.py": "integration-tests/test_image_cookbooks.py",
    "mm/clevr_grpo.py": "integration-tests/test_image_cookbooks.py",
    "client/twinkle/self_host/multi_modal.py": "integration-tests/server/test_images.py",
    "client/tinker/self_host/multi_modal.py": "integration-tests/server/test_images.py",
    **{
        f"client/{client}/self_host/{script}": "integration-tests/server/test_client_cookbooks.py"
        for client, scripts in {
            "twinkle": ["self_cognition.py", "dpo.py", "short_math_grpo.py", "sample.py"],
            "tinker": ["self_cognition.py", "dpo.py", "short_math_grpo.py", "sample.py", "lora.py"],
        }.items()
        for script in scripts
    },
}


def test_every_cookbook_has_a_test_that_runs_it():
    # cookbook/client/server/ holds server launchers, not training scripts.
    scripts = {
        str(path.relative_to(COOKBOOK))
        for path in COOKBOOK.rglob("*.py")
        if path.relative_to(COOKBOOK).parts[:2] != ("client", "server")
    }
    assert scripts == set(COVERED_BY), "map every cookbook to the test that runs it"
    for script, test in COVERED_BY.items():
        runner = "/".join(Path(script).parts[-3:]) if script.startswith("client/") else Path(script).name
        assert runner in (REPO_ROOT / test).read_text(), f"{test} does not run {script}"


@pytest.mark.slow
@pytest.mark.integration
def test_full_parameter_sft_trains_every_batch_of_every_epoch(tmp_path):
    from twinkle.dataset import Dataset, DatasetMeta

    epochs, batch_size = 2, 54
    knobs = {"EPOCHS": str(epochs), "BATCH_SIZE": str(batch_size), "MAX_NEW_TOKENS": "2"}
    completed = run_cookbook("sft/full.py", tmp_path, knobs)
    batches = math.ceil(len(Dataset(DatasetMeta("builtin://self-cognition"))) / batch_size)
    losses = json.loads((tmp_path / "loss.json").read_text())
    assert len(losses) == epochs * batches
    line = re.search(
        r"^loss: first step (\S+) -> last step (\S+) \((\d+) steps, (\d+) epochs of (\d+) batches\)",
        completed.stdout,
        re.M,
    )
    assert line, completed.stdout[-2000:]
    assert (int(line[3]), int(line[4]), int(line[5])) == (epochs * batches, epochs, batches)
    assert float(line[2]) < float(line[1])
    assert (tmp_path / "loss.png").stat().st_size > 0
    checkpoint = tmp_path / "last-checkpoint"  # a complete model, not an adapter
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / "adapter_model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_multi_turn_tool_grpo_plays_tool_calls_and_trains_on_the_samplers_logprobs(tmp_path):
    steps = 3
    knobs = {"WARMUP_STEPS": "60", "WARMUP_BATCH_SIZE": "8", "MAX_STEPS": str(steps), "BATCH_SIZE": "4"}
    completed = run_cookbook("rl/multi_turn_tools.py", tmp_path, {**knobs, "NUM_GENERATIONS": "4"})
    logs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(logs) == steps
    for log in logs:
        assert 0.0 <= log["reward/mean"] <= 1.0 and 0.0 <= log["tool_use_rate"] <= 1.0
        assert 1.0 + log["tool_use_rate"] <= log["turns/mean"] <= 3.0  # a tool call is answered in another turn
        assert log["logprob_mismatch/num_tokens"] > 0 and log["logprob_mismatch/max_abs"] <= 1e-4
    # 60 short warm-up steps already teach the tool-call format: some episodes call the calculator.
    assert any(log["tool_use_rate"] > 0 for log in logs)
    assert re.search(
        r"^reward: first 10 steps \S+ -> last 10 steps \S+; tool-use rate: first 10 \S+ -> last 10 \S+ \(\d+ s",
        completed.stdout,
        re.M,
    ), completed.stdout[-2000:]
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert (tmp_path / "grpo-calculator-checkpoint" / "adapter_model.safetensors").is_file()
