"""cookbook/rl/grpo.py with ``SAMPLER=vllm``, shrunk: the GRPO loop samples with vLLM and trains on its log-probs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in .venv-vllm")

GRPO = Path(__file__).resolve().parents[3] / "cookbook" / "rl" / "grpo.py"
KNOBS = {"WARMUP_STEPS": "4", "MAX_STEPS": "3", "BATCH_SIZE": "2", "NUM_GENERATIONS": "4", "MAX_NEW_TOKENS": "16"}


def test_grpo_cookbook_samples_with_vllm_and_the_trainer_agrees_on_every_logprob(tmp_path):
    env = {**os.environ, **KNOBS, "SAMPLER": "vllm", "OUTPUT_DIR": str(tmp_path), "MPLBACKEND": "Agg"}
    completed = subprocess.run(
        [sys.executable, str(GRPO)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = r"^mean reward: first 10 steps \S+ -> last 10 steps \S+ .*; adapter saved to "
    assert re.search(report, completed.stdout, re.M)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    worst = max(step["logprob_mismatch/max_abs"] for step in steps)
    print(f"GRPO with vLLMSampler: sampler/trainer log-prob mismatch max {worst:.2e} over {len(steps)} steps")
    assert worst <= 1e-5 and all(step["logprob_mismatch/num_tokens"] > 0 for step in steps)
    assert (tmp_path / "reward.png").stat().st_size > 0
