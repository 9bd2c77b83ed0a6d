"""GRPO with the model and the sampler as Ray actors: the same run as in one process, on a private local Ray.

The cookbooks run as a user runs them, shrunk through their knobs. Both runs use
one torch thread (a 1-CPU Ray actor gets one), so the same seed gives the same
floating-point operations in the same order: every step's metrics must be equal,
not merely close. With so short a warm-up no completion earns a reward (and so
no update moves the adapter); the second test checks the weight sync itself on a
step with non-zero advantages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import twinkle  # noqa: E402
from twinkle import DeviceGroup  # noqa: E402
from twinkle.infra import shutdown  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from logprob_gaps import max_logprob_gap  # noqa: E402  # beside this file

pytestmark = pytest.mark.integration
COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook" / "rl"
KNOBS = {"WARMUP_STEPS": "2", "MAX_STEPS": "2", "BATCH_SIZE": "2", "NUM_GENERATIONS": "2", "MAX_NEW_TOKENS": "8"}
LOOPBACK = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$")
TIMING = {"tokens_per_second"}


def test_ray_grpo_equals_the_in_process_run_and_its_ray_is_private(tmp_path):
    listeners, core_pids = {}, set()
    baseline = _start(COOKBOOK / "grpo.py", tmp_path / "in-process")  # alongside: it only needs one core
    on_ray = _finish(*_start(COOKBOOK / "grpo_ray.py", tmp_path / "ray"), lambda pid: _watch(pid, listeners, core_pids))
    in_process = _finish(*baseline)

    assert "group 'model': ranks=[0] device=cpu: Ray placement group" in on_ray
    assert "- TorchSampler: 1 actor(s)" in on_ray
    local_steps, ray_steps = _steps(tmp_path / "in-process"), _steps(tmp_path / "ray")
    rewards = [step["reward/total/mean"] for step in local_steps]
    assert rewards == [step["reward/total/mean"] for step in ray_steps]
    assert [_without(step, TIMING) for step in local_steps] == [_without(step, TIMING) for step in ray_steps]
    assert _last_line(in_process, "last completion:") == _last_line(on_ray, "last completion:")
    for output, output_dir in ((in_process, tmp_path / "in-process"), (on_ray, tmp_path / "ray")):  # their reports
        assert re.search(r"^mean reward: first 10 steps \S+ -> last 10 steps \S+ .*; adapter saved to ", output, re.M)
        assert (output_dir / "reward.png").stat().st_size > 0

    assert {"gcs_server", "raylet"} <= {name for name, _ in listeners.values()}
    assert all(LOOPBACK.match(address) for _, address in listeners.values()), listeners
    time.sleep(0.5)  # the driver has stopped them; let the kernel finish
    assert not [pid for pid in core_pids if _alive(pid)], "raylet/gcs_server outlived the cookbook"


def test_sync_weights_moves_a_trained_adapter_from_the_model_actor_to_the_sampler_actor():
    from peft import LoraConfig

    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.data_format import SamplingParams
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    groups = [DeviceGroup("model", ranks=[0]), DeviceGroup("sampler", ranks=[1])]
    twinkle.initialize(mode="ray", seed=0, groups=groups, lazy_collect=True, num_cpus=2)  # both actors load at once
    try:
        model = TransformersModel(remote_group="model")
        model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"), seed=0)
        model.set_optimizer("AdamW", lr=1e-2)
        model.set_loss("GRPOLoss", epsilon=0.2)
        sampler = TorchSampler(remote_group="sampler")
        sampler.set_template("Template", enable_thinking=False)
        manager = CheckpointEngineManager(model, sampler)
        prompt = [{"messages": [{"role": "user", "content": "What is 12 plus 30?"}]}]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)

        manager.sync_weights()
        first = sampler.sample(prompt, params, adapter_name="default", num_samples=4).sequences
        inputs = [s.new_input_feature for s in first]
        model.forward_backward(inputs=inputs, old_logps=[s.logprobs for s in first], advantages=[1.0, -1.0] * 2)
        model.clip_grad_and_step()
        manager.sync_weights()
        second = sampler.sample(prompt, params, adapter_name="default", num_samples=4).sequences
        trained = model.forward_only(inputs=[s.new_input_feature for s in second])

        moved = max_logprob_gap([s.logprobs for s in first], model.forward_only(inputs=inputs), inputs)
        synced = max_logprob_gap([s.logprobs for s in second], trained, [s.new_input_feature for s in second])
        assert moved > 1e-3  # the step changed the adapter...
        assert synced < 1e-4  # ...and the sampler serves the changed one
    finally:
        shutdown()


def _start(script: Path, output_dir: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, **KNOBS, "OUTPUT_DIR": str(output_dir), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    output_dir.mkdir(parents=True)
    with (output_dir / "stdout.txt").open("w") as out, (output_dir / "stderr.txt").open("w") as err:
        process = subprocess.Popen([sys.executable, str(script)], cwd=output_dir, env=env, stdout=out, stderr=err)
    return process, output_dir


def _finish(process: subprocess.Popen, output_dir: Path, watch=None) -> str:
    """Wait for the run (calling ``watch(pid)`` meanwhile); its stdout."""
    while process.poll() is None:
        if watch is not None:
            watch(process.pid)
        time.sleep(0.5)
    assert process.returncode == 0, (output_dir / "stderr.txt").read_text()[-3000:]
    return (output_dir / "stdout.txt").read_text()


def _watch(root: int, listeners: dict, core_pids: set) -> None:
    """Record every listening TCP socket of ``root``'s process tree, and its raylet and gcs_server."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,comm="], capture_output=True, text=True).stdout.split("\n")
    rows = [line.split(None, 2) for line in table if line.strip()]
    tree, names = {root}, {int(pid): name for pid, _, name in rows}
    while grown := {int(pid) for pid, ppid, _ in rows if int(ppid) in tree} - tree:
        tree |= grown
    core_pids.update(pid for pid in tree if names.get(pid) in ("raylet", "gcs_server"))
    sockets = subprocess.run(["ss", "-tnlpH"], capture_output=True, text=True).stdout.splitlines()
    for line in sockets:
        address = line.split()[3]
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in tree:
                listeners[(pid, address)] = (names.get(pid, "?"), address)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _steps(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _without(step: dict, keys: set[str]) -> dict:
    return {k: v for k, v in step.items() if k not in keys}


def _last_line(stdout: str, prefix: str) -> str:
    return [line for line in stdout.splitlines() if line.startswith(prefix)][-1]
