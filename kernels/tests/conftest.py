"""Triton kernels run in Triton's CPU interpreter here: it must be on before any kernel is decorated."""

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def run_compiled() -> Callable[[str], None]:
    """``run_compiled(test_file)``: runs ``python test_file`` (its GPU checks) in a fresh process without
    ``TRITON_INTERPRET``, where Triton compiles the kernels for the GPU (this process decorated them for the
    interpreter); fails with its output if it fails."""

    def run(test_file: str) -> None:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        result = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr

    return run
