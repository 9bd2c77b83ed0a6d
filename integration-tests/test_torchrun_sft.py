"""The SFT cookbook under ``torchrun --nproc_per_node 2`` (DDP and FSDP2) trains exactly like one process.

Each run is the unchanged cookbook, shrunk through its knobs, with the same
global batch: the loss curves must agree within 1e-4, and the one checkpoint
a torchrun run writes must load in a single process and give the one-process
run's eval loss. The CPU runs use gloo; the CUDA (NCCL) variant needs two GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twinkle.hub import resolve_dataset, resolve_model

REPO_ROOT = Path(__file__).resolve().parents[1]
COOKBOOK = REPO_ROOT / "cookbook" / "sft" / "self_cognition.py"
KNOBS = {"EPOCHS": "1", "BATCH_SIZE": "8", "MAX_STEPS": "4", "MAX_NEW_TOKENS": "2", "MPLBACKEND": "Agg"}
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # two processes share the two cores
TIMEOUT_S = 300
TOLERANCE = 1e-4
MESHES = {"ddp": {}, "fsdp": {"FSDP_SIZE": "2"}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_cookbook(output_dir: Path, extra_env: dict[str, str], nproc: int = 1) -> list[float]:
    """Run the cookbook (under torchrun when ``nproc`` > 1) and return its loss curve; kill it all on failure."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        launcher += ["--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    env = {**os.environ, **KNOBS, **extra_env, "OUTPUT_DIR": str(output_dir)}
    # Its own session, so a hung run is killed with every worker torchrun started.
    process = subprocess.Popen(
        [*launcher, str(COOKBOOK)],
        cwd=output_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the cookbook did not finish within {TIMEOUT_S} s:\n{output[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output[-3000:]
    assert output.count("loss: first step") == 1, output[-2000:]  # rank 0 alone reports
    return json.loads((output_dir / "loss.json").read_text())


def _eval_loss(checkpoint: Path, features: list) -> float:
    """The eval loss of ``checkpoint`` loaded the usual way, in this one process."""
    from twinkle.model import TransformersModel

    model = TransformersModel(device="cpu")
    model.load(checkpoint)
    return model.forward_only(inputs=features).loss


@pytest.fixture(scope="module")
def eval_features() -> list:
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionProcessor

    resolve_model(None)  # build the embedded model and data once, before several processes want them
    resolve_dataset("builtin://self-cognition")
    dataset = Dataset(DatasetMeta("builtin://self-cognition"))
    dataset.set_template("Template", model_id="builtin://qwen3-tiny", max_length=256)
    dataset.map(SelfCognitionProcessor("Twinkle", "ModelScope"))
    dataset.encode()
    return [dataset[i] for i in range(len(dataset) - 8, len(dataset))]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, eval_features) -> tuple[list[float], float]:
    output_dir = tmp_path_factory.mktemp("one-process")
    losses = _run_cookbook(output_dir, CPU_ONLY)
    return losses, _eval_loss(output_dir / "last-checkpoint", eval_features)


def _check_against_one_process(output_dir: Path, losses: list[float], one_process, eval_features) -> None:
    reference, reference_eval = one_process
    print("step  one process     torchrun        |diff|")
    for step, (ours, theirs) in enumerate(zip(reference, losses, strict=True), 1):
        print(f"{step:>4}  {ours:.8f}  {theirs:.8f}  {abs(ours - theirs):.1e}")
    assert len(losses) == int(KNOBS["MAX_STEPS"])
    assert losses == pytest.approx(reference, abs=TOLERANCE)
    checkpoint = output_dir / "last-checkpoint"
    assert sorted(p.name for p in output_dir.iterdir() if p.name.startswith(".")) == []  # no half-written copies
    assert (checkpoint / "adapter_model.safetensors").is_file()
    eval_loss = _eval_loss(checkpoint, eval_features)
    print(f"eval loss of the checkpoint: one process {reference_eval:.8f}, torchrun {eval_loss:.8f}")
    assert eval_loss == pytest.approx(reference_eval, abs=TOLERANCE)


@pytest.mark.integration
@pytest.mark.parametrize("mesh", list(MESHES))
def test_torchrun_sft_matches_one_process(mesh, tmp_path, one_process, eval_features):
    losses = _run_cookbook(tmp_path, {**CPU_ONLY, **MESHES[mesh]}, nproc=2)
    _check_against_one_process(tmp_path, losses, one_process, eval_features)


@pytest.mark.gpu
@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with two ranks needs two GPUs")
@pytest.mark.parametrize("mesh", list(MESHES))
def test_torchrun_sft_on_two_gpus_matches_one_process(mesh, tmp_path, one_process, eval_features):
    # float32 on CUDA: the CPU reference's curve up to kernel rounding.
    losses = _run_cookbook(tmp_path, MESHES[mesh], nproc=2)
    _check_against_one_process(tmp_path, losses, one_process, eval_features)
