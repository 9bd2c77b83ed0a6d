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
