"""Ulysses sequence parallelism over FSDP2 under ``torchrun --nproc_per_node 2`` trains exactly like one process.

The sequence-parallel cookbook, shrunk through its knobs, runs once in one
process and once split over two (every batch's tokens halved, attention heads
exchanged): the loss curves must agree within 1e-4 over five steps, on packed
rows of the dense builtin and on padded rows of the MoE builtin with
activation checkpointing, and the adapter the torchrun run saves must load in
one process with the one-process run's eval loss. A group size the model's
heads cannot split is refused before anything trains.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle.hub import resolve_dataset, resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_harness import CPU_ONLY, TIMEOUT_S, free_port, print_curves, run_cookbook

REPO_ROOT = Path(__file__).resolve().parents[1]
COOKBOOK = REPO_ROOT / "cookbook" / "sft" / "sequence_parallel.py"
KNOBS = {**CPU_ONLY, "EPOCHS": "1", "BATCH_SIZE": "8", "MAX_STEPS": "5", "MAX_NEW_TOKENS": "2"}
TOLERANCE = 1e-4
RUNS = {
    "dense-packed": {"MODEL_ID": "builtin://qwen3-tiny", "PADDING_FREE": "1"},
    "moe-padded-checkpointed": {
        "MODEL_ID": "builtin://qwen3-moe-tiny",
        "PADDING_FREE": "0",
        "GRADIENT_CHECKPOINTING": "1",
    },
}


@pytest.fixture(scope="module", autouse=True)
def _embedded_defaults() -> None:
    for model_id in {run["MODEL_ID"] for run in RUNS.values()}:  # built once, before several processes want them
        resolve_model(model_id)
    resolve_dataset("builtin://self-cognition")


def _eval_loss(model_id: str, checkpoint: Path) -> float:
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.model import TransformersModel
    from twinkle.preprocessor import SelfCognitionProcessor

    dataset = Dataset(DatasetMeta("builtin://self-cognition"))
    dataset.set_template("Template", model_id=model_id, max_length=256)
    dataset.map(SelfCognitionProcessor("Twinkle", "ModelScope"))
    dataset.encode()
    model = TransformersModel(model_id, device="cpu")
    model.add_adapter_to_model("default", checkpoint)
    return model.forward_only(inputs=[dataset[i] for i in range(len(dataset) - 8, len(dataset))]).loss


@pytest.mark.integration
@pytest.mark.parametrize("run", list(RUNS))
def test_ulysses_over_fsdp2_matches_one_process(run, tmp_path):
    knobs = {**KNOBS, **RUNS[run]}
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    reference, _ = run_cookbook(COOKBOOK, tmp_path / "one", {**knobs, "ULYSSES_SIZE": "1"})
    losses, output = run_cookbook(COOKBOOK, tmp_path / "split", {**knobs, "ULYSSES_SIZE": "2"}, nproc=2)
    assert "2 process(es), ulysses_size=2" in output, output[-2000:]
    print_curves(reference, losses)
    assert len(losses) == int(KNOBS["MAX_STEPS"])
    assert losses == pytest.approx(reference, abs=TOLERANCE)
    assert losses[-1] < losses[0]
    model_id = knobs["MODEL_ID"]
    one = _eval_loss(model_id, tmp_path / "one" / "last-checkpoint")
    split = _eval_loss(model_id, tmp_path / "split" / "last-checkpoint")
    print(f"eval loss of the adapter: one process {one:.8f}, ulysses_size=2 {split:.8f}")
    assert split == pytest.approx(one, abs=TOLERANCE)


@pytest.mark.integration
def test_group_size_that_does_not_split_the_heads_is_refused(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--master_addr=127.0.0.1"]
    completed = subprocess.run(
        [*launcher, f"--master_port={free_port()}", str(COOKBOOK)],
        cwd=tmp_path,
        env={**os.environ, **KNOBS, "ULYSSES_SIZE": "3", "OUTPUT_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert completed.returncode != 0
    assert "ulysses_size=3 must divide the model's attention heads (num_attention_heads=4" in completed.stderr
    assert not (tmp_path / "last-checkpoint").exists() and not (tmp_path / "loss.json").exists()
