"""Running a cookbook script in one process or under ``torchrun`` on CPU, as a user would, and reading its losses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # two processes share the two cores
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cookbook(script: Path, output_dir: Path, env: dict[str, str], nproc: int = 1) -> tuple[list[float], str]:
    """Run ``script`` (under torchrun when ``nproc`` > 1); its ``loss.json`` and output. Everything dies on failure."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        launcher += ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    # Its own session, so a hung run is killed with every worker torchrun started.
    process = subprocess.Popen(
        [*launcher, str(script)],
        cwd=output_dir,
        env={**os.environ, "MPLBACKEND": "Agg", **env, "OUTPUT_DIR": str(output_dir)},  # figures without a display
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
        pytest.fail(f"{script.name} did not finish within {TIMEOUT_S} s:\n{output[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output[-3000:]
    return json.loads((output_dir / "loss.json").read_text()), output


def print_curves(reference: list[float], losses: list[float]) -> None:
    print("step  one process     torchrun        |diff|")
    for step, (ours, theirs) in enumerate(zip(reference, losses, strict=True), 1):
        print(f"{step:>4}  {ours:.8f}  {theirs:.8f}  {abs(ours - theirs):.1e}")


def adapter_eval_loss(model_id: str, checkpoint: Path) -> float:
    """The self-cognition eval loss (its last 8 samples) of the adapter saved in ``checkpoint``, in this process."""
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


def compare_cookbook_runs(
    script: Path, output_dir: Path, knobs: dict[str, str], split: dict[str, str], compare_adapters: bool = True
) -> str:
    """Run ``script`` in one process, then under ``torchrun --nproc_per_node 2`` with ``split`` knobs added.

    The loss curves must agree within 1e-4 and fall; so must (``compare_adapters``) the saved adapters' eval
    losses in one process. Returns the torchrun run's output.
    """
    (output_dir / "one").mkdir()
    (output_dir / "split").mkdir()
    reference, _ = run_cookbook(script, output_dir / "one", knobs)
    losses, output = run_cookbook(script, output_dir / "split", {**knobs, **split}, nproc=2)
    print_curves(reference, losses)
    assert len(losses) == int(knobs["MAX_STEPS"])
    assert losses == pytest.approx(reference, abs=1e-4)
    assert losses[-1] < losses[0]
    if not compare_adapters:
        return output
    one = adapter_eval_loss(knobs["MODEL_ID"], output_dir / "one" / "last-checkpoint")
    two = adapter_eval_loss(knobs["MODEL_ID"], output_dir / "split" / "last-checkpoint")
    print(f"eval loss of the adapter: one process {one:.8f}, torchrun {two:.8f}")
    assert two == pytest.approx(one, abs=1e-4)
    return output


def run_refusals(cases: list[str], nproc: int) -> dict[str, str]:
    """Run ``mesh_refusals.py`` under torchrun: each case's refusal message (or ``"ACCEPTED"``)."""
    script = Path(__file__).parent / "mesh_refusals.py"
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    launcher += ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    completed = subprocess.run(
        [*launcher, str(script), *cases],
        env={**os.environ, **CPU_ONLY},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    outcomes = {}
    for line in completed.stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        if verdict in ("REFUSED", "ACCEPTED"):
            case, _, message = rest.partition(": ")
            outcomes[case] = message if verdict == "REFUSED" else "ACCEPTED"
    assert sorted(outcomes) == sorted(cases), completed.stdout[-3000:]
    return outcomes
