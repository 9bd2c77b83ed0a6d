"""Built-in metrics resolve by name and entry point, implement the Metric ABC, and import without torch."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from twinkle.interfaces import Metric
from twinkle.registry import build, get_registry

BUILTINS = ["CompletionRewardMetric", "DPOMetric", "LogprobMismatchMetric", "PolicyMetric"]


def test_builtins_resolve_by_name_and_entry_point():
    published = {ep.name: ep for ep in entry_points(group="twinkle.metric")}
    assert set(BUILTINS) <= set(published)
    for name in BUILTINS:
        assert published[name].load() is get_registry("metric").get(name)
        metric = build("metric", name)
        assert isinstance(metric, Metric)
        assert metric.calculate() == {}


def test_import_needs_no_torch():
    code = "import sys, twinkle.metric\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True)
