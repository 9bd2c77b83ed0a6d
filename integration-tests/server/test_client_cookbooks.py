"""The client cookbooks (cookbook/client/{twinkle,tinker}/self_host/) run as a user runs them, against one server.

One ``twinkle server`` serves the whole module, and two users use it at once, as two tenants would:
one runs the Twinkle-client scripts, the other the Tinker SDK scripts, each user's scripts one
after the other. Every script runs as its own process, shrunk through its knobs, with nothing but
``TWINKLE_BASE_URL`` and ``TWINKLE_API_KEY`` (the Tinker SDK gets its settings from
``init_tinker_client``), and each test checks what its script printed. The Twinkle-client scripts
run as on a machine without torch, transformers, peft or datasets (importing them fails), so a
recipe that reaches for a torch-backed module remotely fails here. The sampling scripts sample the
adapters the SFT scripts saved.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sdk_process import script_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS = Path(__file__).resolve().parents[2] / "cookbook" / "client"
TIMEOUT_S = 240  # per script; each takes 5-35 s
# What ``pip install twinkle-client`` leaves out; the runner makes their imports fail as if not installed.
NOT_INSTALLED = ("torch", "transformers", "peft", "datasets")
WITHOUT_TORCH = f"""
import pathlib, runpy, sys
for name in {NOT_INSTALLED!r}:
    sys.modules[name] = None  # 'import name' raises ImportError; importlib.util.find_spec(name) is None
script = sys.argv[1]
sys.argv, sys.path[0] = [script], str(pathlib.Path(script).parent)  # as 'python script' sets them
runpy.run_path(script, run_name="__main__")
"""


@dataclass
class Run:
    """One script's run: where it wrote its files, what it printed, and why it failed (empty if it did not)."""

    output_dir: Path
    stdout: str
    failure: str
    timed_out: bool = False

    def output(self) -> str:
        assert not self.failure, self.failure
        return self.stdout


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["twinkle-user", "tinker-user"])


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory) -> dict[str, Run]:
    """Every script's run, by script path; the two users' scripts run side by side."""
    results: dict[str, Run] = {}
    stalled = threading.Event()  # a script timed out: the server is stuck, so the rest would only wait too

    def start(user: str, script: str, **knobs: str) -> Run:
        output_dir = tmp_path_factory.mktemp(Path(script).stem)
        if stalled.is_set():
            results[script] = Run(output_dir, "", f"{script} was not run: an earlier script timed out")
        else:
            results[script] = run_script(server, user, script, output_dir, knobs)
        if results[script].timed_out:
            stalled.set()
        return results[script]

    def twinkle_client_scripts() -> None:
        sft = start("twinkle-user", "twinkle/self_host/self_cognition.py", MAX_STEPS="2", BATCH_SIZE="4")
        adapter = saved_path(sft, "twinkle://")
        start("twinkle-user", "twinkle/self_host/sample.py", ADAPTER_PATH=adapter)
        start("twinkle-user", "twinkle/self_host/dpo.py", MAX_STEPS="1", BATCH_SIZE="2", EVAL_PAIRS="2")
        grpo = {"WARMUP_STEPS": "1", "MAX_STEPS": "1", "BATCH_SIZE": "2", "NUM_GENERATIONS": "2"}
        start("twinkle-user", "twinkle/self_host/short_math_grpo.py", **grpo, MAX_NEW_TOKENS="4")

    def tinker_scripts() -> None:
        sft = start("tinker-user", "tinker/self_host/self_cognition.py", MAX_STEPS="3", BATCH_SIZE="4")
        weights = saved_path(sft, "tinker://")
        start("tinker-user", "tinker/self_host/sample.py", MODEL_PATH=weights)
        start("tinker-user", "tinker/self_host/lora.py", EPOCHS="2", STEPS_PER_EPOCH="2")
        start("tinker-user", "tinker/self_host/dpo.py", MAX_STEPS="2", BATCH_SIZE="2", EVAL_PAIRS="2")
        grpo = {"MAX_STEPS": "2", "BATCH_SIZE": "2", "NUM_GENERATIONS": "2", "MAX_NEW_TOKENS": "4"}
        start("tinker-user", "tinker/self_host/short_math_grpo.py", **grpo)

    with ThreadPoolExecutor(2) as pool:
        for lane in [pool.submit(twinkle_client_scripts), pool.submit(tinker_scripts)]:
            lane.result()
    return results


def run_script(server, user: str, script: str, output_dir: Path, knobs: dict[str, str]) -> Run:
    """``python cookbook/client/<script>`` as ``user``, with ``knobs``; a Twinkle-client script runs without torch."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TINKER_")}
    env |= {
        "TWINKLE_BASE_URL": server.url,
        "TWINKLE_API_KEY": server.keys[user],
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        "OUTPUT_DIR": str(output_dir),
        "MAX_NEW_TOKENS": "2",  # every sampling script's; GRPO's completions need a few more
        **knobs,
    }
    path = str(CLIENTS / script)
    command = [sys.executable, "-c", WITHOUT_TORCH, path] if script.startswith("twinkle/") else script_command(path)
    try:
        done = subprocess.run(command, cwd=output_dir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        failure = f"{script} did not finish within {TIMEOUT_S} s:\n{stderr[-3000:]}"
        return Run(output_dir, "", f"{failure}\n--- server log:\n{server.log()[-3000:]}", timed_out=True)
    if done.returncode != 0:
        failure = f"{script} exited with {done.returncode}:\n{done.stderr[-3000:]}"
        return Run(output_dir, done.stdout, f"{failure}\n--- server log:\n{server.log()[-3000:]}")
    return Run(output_dir, done.stdout, "")


def saved_path(run: Run, scheme: str) -> str:
    """The checkpoint path a script reports last ('' when it has none: the script that needs it then fails)."""
    paths = re.findall(rf"saved to ({scheme}\S+)$", run.stdout, re.M)
    return paths[-1] if paths else ""


def final_line(run: Run, pattern: str) -> re.Match:
    output = run.output()
    match = re.fullmatch(pattern, output.strip().splitlines()[-1])
    assert match, output[-2000:]
    return match


# ----------------------------------------------------------------------------------------- Twinkle client


def test_twinkle_self_cognition_trains_the_recipe_remotely(runs):
    run = runs["twinkle/self_host/self_cognition.py"]
    output = run.output()
    line = re.search(r"^loss: first step (\S+) -> last step \S+; adapter saved to (twinkle://\S+)$", output, re.M)
    assert line, output[-2000:]
    assert line[2].endswith("/last-checkpoint")
    losses = json.loads((run.output_dir / "loss.json").read_text())
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert f"{losses[0]:.3f}" == line[1]
    assert (run.output_dir / "loss.png").stat().st_size > 0
    assert output.count("\nQ: ") == 4  # the recipe's four questions, answered by the server's sampler


def test_twinkle_sample_uses_the_saved_adapter(runs):
    adapter = saved_path(runs["twinkle/self_host/self_cognition.py"], "twinkle://")
    run = runs["twinkle/self_host/sample.py"]
    final_line(run, rf"sampled 4 completions \(2 questions x 2\) from {re.escape(adapter)}")
    assert run.output().count("Q: ") == 4


def test_twinkle_dpo_trains_the_recipe_remotely(runs):
    run = runs["twinkle/self_host/dpo.py"]
    assert re.search(r"^held-out preference accuracy before training: \S+$", run.output(), re.M), run.stdout
    final_line(
        run,
        r"training preference accuracy \S+, margin \S+; held-out preference accuracy after training: \S+; "
        r"adapter saved to twinkle://\S+/dpo-checkpoint",
    )
    assert len(json.loads((run.output_dir / "loss.json").read_text())) == 1


def test_twinkle_short_math_grpo_samples_the_adapter_it_trains(runs):
    run = runs["twinkle/self_host/short_math_grpo.py"]
    line = re.search(
        r"^mean reward: first 10 steps \S+ -> last 10 steps \S+ \(.*\); sampler/trainer logprob mismatch max (\S+); "
        r"adapter saved to twinkle://\S+/grpo-gsm8k-checkpoint$",
        run.output(),
        re.M,
    )
    assert line, run.stdout[-2000:]
    assert float(line[1]) < 1e-4  # the sampler used the trained adapter's weights
    marker = run.output_dir / "warmup-1-steps" / "checkpoint-path"
    assert marker.read_text().startswith("twinkle://")  # the warm-up checkpoint stays on the server
    assert (run.output_dir / "reward.png").stat().st_size > 0


# ----------------------------------------------------------------------------------------- Tinker SDK


def test_tinker_self_cognition_lowers_the_loss(runs):
    run = runs["tinker/self_host/self_cognition.py"]
    line = final_line(run, r"loss: first step (\S+) -> last step (\S+); adapter saved to (tinker://\S+)")
    assert float(line[2]) < float(line[1])
    assert line[3].endswith("/sampler_weights/self-cognition")


def test_tinker_sample_uses_the_saved_sampler_weights(runs):
    weights = saved_path(runs["tinker/self_host/self_cognition.py"], "tinker://")
    final_line(
        runs["tinker/self_host/sample.py"], rf"sampled 4 completions \(2 questions x 2\) from {re.escape(weights)}"
    )


def test_tinker_lora_loop_lowers_the_loss_and_saves_every_epoch(runs):
    run = runs["tinker/self_host/lora.py"]
    line = final_line(run, r"loss per token: first step (\S+) -> last step (\S+); state saved to (tinker://\S+)")
    assert float(line[2]) < float(line[1])  # four steps on the same seven phrases
    assert line[3].endswith("/weights/pig-latin-epoch-2")
    assert len(re.findall(r"^epoch \d: loss per token \S+; state saved to tinker://", run.stdout, re.M)) == 2


def test_tinker_dpo_reference_is_the_base_model(runs):
    run = runs["tinker/self_host/dpo.py"]
    assert re.search(r"^held-out preference accuracy before training: \S+$", run.output(), re.M), run.stdout
    line = final_line(
        run,
        r"DPO loss: first step (\S+) -> last step (\S+); last batch accuracy \S+, margin \S+; "
        r"held-out preference accuracy after training: \S+; adapter saved to (tinker://\S+)",
    )
    # Before its first step the policy is the base model, so every margin is 0 and the loss is log 2:
    # the reference log-probs (a base-model sampling client) equal the policy's (the training client's).
    assert float(line[1]) == pytest.approx(math.log(2), abs=1e-3)
    assert line[3].endswith("/weights/dpo")


def test_tinker_short_math_grpo_samples_the_weights_it_trains(runs):
    line = final_line(
        runs["tinker/self_host/short_math_grpo.py"],
        r"mean reward: first 10 steps \S+ -> last 10 steps \S+; sampler/trainer logprob mismatch max (\S+); "
        r"adapter saved to (tinker://\S+)",
    )
    assert float(line[1]) < 1e-4
    assert line[2].endswith("/sampler_weights/grpo-gsm8k")


def test_the_server_logged_no_errors(server, runs):
    assert server.errors() == []
