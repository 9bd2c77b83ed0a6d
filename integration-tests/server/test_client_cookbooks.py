"""The client cookbooks (cookbook/client/{twinkle,tinker}/self_host/) run as a user runs them, against one server.

One ``twinkle server`` serves the whole module. Every script runs as its own process, shrunk through
its knobs, with nothing but ``TWINKLE_BASE_URL`` and ``TWINKLE_API_KEY`` (the Tinker SDK gets its
settings from ``init_tinker_client``), and each test checks the line the script ends with. The
Twinkle-client scripts run as on a machine without torch, transformers, peft or datasets (those
imports fail), so a recipe that reaches for a torch-backed module remotely fails here. The sampling
scripts sample the adapters the SFT scripts saved.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CLIENTS = Path(__file__).resolve().parents[2] / "cookbook" / "client"
TIMEOUT_S = 300
# What ``pip install twinkle-client`` leaves out; the runner makes their imports fail as if not installed.
NOT_INSTALLED = ("torch", "transformers", "peft", "datasets")
WITHOUT_TORCH = f"""
import runpy, sys
for name in {NOT_INSTALLED!r}:
    sys.modules[name] = None  # 'import name' raises ImportError; importlib.util.find_spec(name) is None
script = sys.argv[1]
sys.argv, sys.path[0] = [script], str(__import__("pathlib").Path(script).parent)
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["me"])


def run(server, script: str, output_dir: Path, **knobs: str) -> str:
    """Run ``cookbook/client/<script>`` with ``knobs``; its stdout. A Twinkle-client script runs without torch."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TINKER_")}
    env |= {
        "TWINKLE_BASE_URL": server.url,
        "TWINKLE_API_KEY": server.keys["me"],
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        "OUTPUT_DIR": str(output_dir),
        **knobs,
    }
    path = str(CLIENTS / script)
    command = [sys.executable, "-c", WITHOUT_TORCH, path] if script.startswith("twinkle/") else [sys.executable, path]
    done = subprocess.run(command, cwd=output_dir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def final_line(output: str, pattern: str) -> re.Match:
    match = re.fullmatch(pattern, output.strip().splitlines()[-1])
    assert match, output[-2000:]
    return match


# ----------------------------------------------------------------------------------------- Twinkle client


@pytest.fixture(scope="module")
def twinkle_sft(server, tmp_path_factory) -> tuple[str, Path]:
    output_dir = tmp_path_factory.mktemp("twinkle-sft")
    output = run(
        server, "twinkle/self_host/self_cognition.py", output_dir, MAX_STEPS="2", BATCH_SIZE="4", MAX_NEW_TOKENS="2"
    )
    return output, output_dir


def test_twinkle_self_cognition_trains_the_recipe_remotely(twinkle_sft):
    output, output_dir = twinkle_sft
    loss_line = re.search(
        r"^loss: first step (\S+) -> last step (\S+); adapter saved to (twinkle://\S+)$", output, re.M
    )
    assert loss_line, output[-2000:]
    assert loss_line[3].endswith("/last-checkpoint")
    losses = json.loads((output_dir / "loss.json").read_text())
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert f"{losses[0]:.3f}" == loss_line[1]
    assert (output_dir / "loss.png").stat().st_size > 0
    assert output.count("\nQ: ") == 4  # the recipe's four questions, answered by the server's sampler


def test_twinkle_sample_uses_the_saved_adapter(server, twinkle_sft, tmp_path):
    adapter = re.search(r"adapter saved to (twinkle://\S+)", twinkle_sft[0])[1]
    output = run(server, "twinkle/self_host/sample.py", tmp_path, ADAPTER_PATH=adapter, MAX_NEW_TOKENS="2")
    final_line(output, rf"sampled 4 completions \(2 questions x 2\) from {re.escape(adapter)}")
    assert output.count("Q: ") == 4


@pytest.mark.slow
def test_twinkle_dpo_trains_the_recipe_remotely(server, tmp_path):
    output = run(server, "twinkle/self_host/dpo.py", tmp_path, MAX_STEPS="1", BATCH_SIZE="2", EVAL_PAIRS="2")
    assert re.search(r"^held-out preference accuracy before training: \S+$", output, re.M), output[-2000:]
    final_line(
        output,
        r"training preference accuracy \S+, margin \S+; held-out preference accuracy after training: \S+; "
        r"adapter saved to twinkle://\S+/dpo-checkpoint",
    )
    assert len(json.loads((tmp_path / "loss.json").read_text())) == 1


@pytest.mark.slow
def test_twinkle_short_math_grpo_samples_the_adapter_it_trains(server, tmp_path):
    knobs = {"WARMUP_STEPS": "1", "MAX_STEPS": "1", "BATCH_SIZE": "2", "NUM_GENERATIONS": "2", "MAX_NEW_TOKENS": "4"}
    output = run(server, "twinkle/self_host/short_math_grpo.py", tmp_path, **knobs)
    line = re.search(
        r"^mean reward: first 10 steps \S+ -> last 10 steps \S+ \(.*\); sampler/trainer logprob mismatch max (\S+); "
        r"adapter saved to twinkle://\S+/grpo-gsm8k-checkpoint$",
        output,
        re.M,
    )
    assert line, output[-2000:]
    assert float(line[1]) < 1e-4  # the sampler used the trained adapter's weights
    marker = tmp_path / "warmup-1-steps" / "checkpoint-path"
    assert marker.read_text().startswith("twinkle://")  # the warm-up checkpoint stays on the server
    assert (tmp_path / "reward.png").stat().st_size > 0


# ----------------------------------------------------------------------------------------- Tinker SDK


@pytest.fixture(scope="module")
def tinker_sft(server, tmp_path_factory) -> str:
    return run(
        server,
        "tinker/self_host/self_cognition.py",
        tmp_path_factory.mktemp("tinker-sft"),
        MAX_STEPS="3",
        BATCH_SIZE="4",
    )


def test_tinker_self_cognition_lowers_the_loss(tinker_sft):
    line = final_line(tinker_sft, r"loss: first step (\S+) -> last step (\S+); adapter saved to (tinker://\S+)")
    assert float(line[2]) < float(line[1])
    assert line[3].endswith("/sampler_weights/self-cognition")


def test_tinker_sample_uses_the_saved_sampler_weights(server, tinker_sft, tmp_path):
    weights = re.search(r"adapter saved to (tinker://\S+)", tinker_sft)[1]
    output = run(server, "tinker/self_host/sample.py", tmp_path, MODEL_PATH=weights, MAX_NEW_TOKENS="2")
    final_line(output, rf"sampled 4 completions \(2 questions x 2\) from {re.escape(weights)}")


def test_tinker_lora_loop_lowers_the_loss_and_saves_every_epoch(server, tmp_path):
    output = run(server, "tinker/self_host/lora.py", tmp_path, EPOCHS="2", STEPS_PER_EPOCH="2", MAX_NEW_TOKENS="2")
    line = final_line(output, r"loss per token: first step (\S+) -> last step (\S+); state saved to (tinker://\S+)")
    assert float(line[2]) < float(line[1])  # four steps on the same seven phrases
    assert line[3].endswith("/weights/pig-latin-epoch-2")
    assert len(re.findall(r"^epoch \d: loss per token \S+; state saved to tinker://", output, re.M)) == 2


@pytest.mark.slow
def test_tinker_dpo_reference_is_the_base_model(server, tmp_path):
    output = run(server, "tinker/self_host/dpo.py", tmp_path, MAX_STEPS="2", BATCH_SIZE="2", EVAL_PAIRS="2")
    assert re.search(r"^held-out preference accuracy before training: \S+$", output, re.M), output[-2000:]
    line = final_line(
        output,
        r"DPO loss: first step (\S+) -> last step (\S+); last batch accuracy \S+, margin \S+; "
        r"held-out preference accuracy after training: \S+; adapter saved to (tinker://\S+)",
    )
    # Before its first step the policy is the base model, so every margin is 0 and the loss is log 2:
    # the reference log-probs (a base-model sampling client) equal the policy's (the training client's).
    assert float(line[1]) == pytest.approx(math.log(2), abs=1e-3)
    assert line[3].endswith("/weights/dpo")


@pytest.mark.slow
def test_tinker_short_math_grpo_samples_the_weights_it_trains(server, tmp_path):
    knobs = {"MAX_STEPS": "2", "BATCH_SIZE": "2", "NUM_GENERATIONS": "2", "MAX_NEW_TOKENS": "4"}
    output = run(server, "tinker/self_host/short_math_grpo.py", tmp_path, **knobs)
    line = final_line(
        output,
        r"mean reward: first 10 steps \S+ -> last 10 steps \S+; sampler/trainer logprob mismatch max (\S+); "
        r"adapter saved to (tinker://\S+)",
    )
    assert float(line[1]) < 1e-4
    assert line[2].endswith("/sampler_weights/grpo-gsm8k")


def test_the_server_logged_no_errors(server):
    assert server.errors() == []
