"""The dataloader must work on a client without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_import_does_not_load_torch():
    result = _run(
        """
        import sys
        import twinkle.dataloader
        assert "torch" not in sys.modules, "twinkle.dataloader imported torch"
        """
    )
    assert result.returncode == 0, result.stderr


def test_batches_slices_and_state_work_with_torch_unavailable():
    result = _run(
        """
        import sys
        sys.modules["torch"] = None  # any "import torch" now fails, as on a torch-free client
        from twinkle.dataloader import DataLoader
        from twinkle.infra import DeviceMesh

        mesh = DeviceMesh.from_sizes(dp_size=4)
        loader = DataLoader(list(range(16)), batch_size=8, shuffle=True, device_mesh=mesh, rank=1)
        batches = [list(batch) for batch in loader]
        assert [len(batch) for batch in batches] == [2, 2], batches
        resumed = DataLoader(list(range(16)), batch_size=8, shuffle=True, device_mesh=mesh, rank=1)
        resumed.load_state(loader.get_state())
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
