"""The DPO cookbook under ``torchrun --nproc_per_node 2`` (DDP and FSDP2) trains exactly like one process.

Each rank takes whole pairs of every batch from the DataLoader and lays them
out itself (chosen, then rejected), so no pair is split; the loss divides by
the global batch's number of pairs and the loss's metrics are averaged with
each rank's share of them. The unchanged cookbook, shrunk through its knobs,
must give the one-process loss curve (1e-4), training accuracy and margin,
and held-out accuracy. This run is also the cookbook's own end-to-end test.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_harness import CPU_ONLY, print_curves, run_cookbook

pytestmark = pytest.mark.integration

COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook" / "rl" / "dpo.py"
KNOBS = {**CPU_ONLY, "BATCH_SIZE": "8", "MAX_STEPS": "3", "EVAL_PAIRS": "24"}
MESHES = {"ddp": {}, "fsdp": {"FSDP_SIZE": "2"}}  # FSDP2 shards the frozen reference model too
REPORT = re.compile(
    r"training preference accuracy (\S+), margin (\S+); held-out preference accuracy after training: (\S+);"
)


def _run(output_dir: Path, env: dict[str, str], nproc: int = 1) -> tuple[list[float], tuple[str, ...]]:
    losses, output = run_cookbook(COOKBOOK, output_dir, {**KNOBS, **env}, nproc)
    reports = REPORT.findall(output)
    assert len(reports) == 1, output[-2000:]  # rank 0 alone reports
    assert (output_dir / "dpo-checkpoint" / "adapter_model.safetensors").is_file()
    return losses, reports[0]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[list[float], tuple[str, ...]]:
    losses, report = _run(tmp_path_factory.mktemp("one-process"), {})
    assert len(losses) == 3 and losses[-1] < losses[0]  # it learns
    return losses, report


@pytest.mark.parametrize("mesh", list(MESHES))
def test_torchrun_dpo_matches_one_process(mesh, tmp_path, one_process):
    losses, report = _run(tmp_path, MESHES[mesh], nproc=2)
    reference, reference_report = one_process
    print_curves(reference, losses)
    assert losses == pytest.approx(reference, abs=1e-4)
    assert report == reference_report  # accuracy, margin (3 decimals) and held-out accuracy
