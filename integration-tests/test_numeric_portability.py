"""The numeric equivalence tests pass on every x86 CPU, not only on the one CI happens to run on.

torch picks its CPU kernels by the vector width the processor has (AVX-512, AVX2 or scalar), and each
width sums the same products in another order. A tolerance that only holds for one order passes on one
machine and fails on another (an fp32 comparison after an optimizer step once failed on an AVX2 AMD EPYC
and passed on AVX-512 machines). Here the tests whose numbers go through reductions, accumulation and
optimizer steps run again on torch's scalar kernels (``ATEN_CPU_CAPABILITY=default``), the order most
unlike the vectorised one the rest of the suite uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
NUMERIC_TESTS = [
    "packages/twinkle-model/tests/test_multi_lora_equivalence.py",
    "packages/twinkle-model/tests/test_gradients.py",
    "packages/twinkle-model/tests/test_peft_parity.py",
]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_numeric_tests_pass_on_scalar_cpu_kernels():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "DEFAULT", f"torch ignored ATEN_CPU_CAPABILITY: {probe.stdout!r}"
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NUMERIC_TESTS],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-4000:]
