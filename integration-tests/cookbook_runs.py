"""Running a cookbook script as a user runs it, for the tests that check what it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook"


def run_cookbook(script: str, output_dir: Path, knobs: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``cookbook/<script>`` with its env-var ``knobs``, writing to ``output_dir``; it must succeed."""
    completed = subprocess.run(
        [sys.executable, str(COOKBOOK / script)],
        cwd=output_dir,
        env={**os.environ, **knobs, "OUTPUT_DIR": str(output_dir), "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed
