"""Kill and resume: "train 10 steps" equals "train 5, save, resume in a new process, train 5", bit for bit on CPU.

The run uses LoRA dropout (so the RNG state must come back), AdamW with a
cosine warm-up schedule (optimizer and scheduler state), and a shuffling
DataLoader over 24 rows, 6 batches an epoch, so the resumed steps cross into
the second epoch (the loader position and the next epoch's order).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration  # three processes

WORKER = Path(__file__).with_name("resume_worker.py")


def _start(tmp_path: Path, tag: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """Start a worker; its output goes to a file (an unread pipe could fill up and stall it)."""
    # Each process gets its own datasets cache, so concurrent workers never write the same cache files.
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / f"hf-datasets-{tag}")}
    log = tmp_path / f"{tag}.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, str(WORKER), *args], env=env, stdout=output, stderr=subprocess.STDOUT
        )
    return process, log


def _losses(worker: tuple[subprocess.Popen, Path]) -> list[str]:
    process, log = worker
    process.wait(timeout=300)
    output = log.read_text()
    assert process.returncode == 0, output[-3000:]
    return json.loads(output.strip().splitlines()[-1])["losses"]


def test_resumed_run_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    # All three start at once: the second half waits for the first half's checkpoint to appear.
    workers = [
        _start(tmp_path, "full", "--steps", "10", "--final", str(tmp_path / "uninterrupted")),
        _start(tmp_path, "first", "--steps", "5", "--save-after", "5", "--checkpoint-dir", str(checkpoints)),
        _start(
            tmp_path,
            "second",
            "--steps",
            "5",
            "--resume",
            str(checkpoints / "resumable"),
            "--final",
            str(tmp_path / "resumed"),
        ),
    ]
    try:
        all_losses, first_losses, resumed_losses = (_losses(worker) for worker in workers)
    finally:
        for process, _ in workers:  # a failed worker must not leave the others waiting
            if process.poll() is None:
                process.kill()
                process.wait()

    assert first_losses == all_losses[:5]
    assert resumed_losses == all_losses[5:]  # float.hex strings: equal means bit-identical
    assert len(set(all_losses)) == 10
    expected = load_file(tmp_path / "uninterrupted" / "final" / "adapter_model.safetensors")
    actual = load_file(tmp_path / "resumed" / "final" / "adapter_model.safetensors")
    assert expected.keys() == actual.keys() and expected
    assert all(torch.equal(actual[key], expected[key]) for key in expected)
    saved_state = json.loads((checkpoints / "resumable" / "twinkle_state.json").read_text())
    assert saved_state["counters"]["global_step"] == 5
    assert saved_state["dataloader"]["batches_consumed"] == 5
