"""The SFT cookbook under ``torchrun --nproc_per_node 2`` (DDP and FSDP2) trains exactly like one process.

Each run is the unchanged cookbook, shrunk through its knobs, with the same
global batch: the loss curves must agree within 1e-4, and the one checkpoint
a torchrun run writes must load in a single process and give the one-process
run's eval loss. The CPU runs use gloo; the CUDA (NCCL) variant needs two GPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from twinkle.hub import resolve_dataset, resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_harness import CPU_ONLY, print_curves, run_cookbook

REPO_ROOT = Path(__file__).resolve().parents[1]
COOKBOOK = REPO_ROOT / "cookbook" / "sft" / "self_cognition.py"
KNOBS = {"EPOCHS": "1", "BATCH_SIZE": "8", "MAX_STEPS": "4", "MAX_NEW_TOKENS": "2"}
TOLERANCE = 1e-4
MESHES = {"ddp": {}, "fsdp": {"FSDP_SIZE": "2"}}


def _run_cookbook(output_dir: Path, extra_env: dict[str, str], nproc: int = 1) -> list[float]:
    losses, output = run_cookbook(COOKBOOK, output_dir, {**KNOBS, **extra_env}, nproc)
    assert output.count("loss: first step") == 1, output[-2000:]  # rank 0 alone reports
    return losses


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
    assert (output_dir / "loss.png").stat().st_size > 0  # also the cookbook's own end-to-end run
    return losses, _eval_loss(output_dir / "last-checkpoint", eval_features)


def _check_against_one_process(output_dir: Path, losses: list[float], one_process, eval_features) -> None:
    reference, reference_eval = one_process
    print_curves(reference, losses)
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
