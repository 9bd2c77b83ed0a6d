"""Bad inputs raise InvalidInputError naming the problem; built-ins resolve by name; no torch on import."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from twinkle.advantage import GAEAdvantage, GRPOAdvantage, ReinforcePlusPlusAdvantage, RLOOAdvantage
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Advantage
from twinkle.registry import build, get_registry

BUILTINS = ["GAEAdvantage", "GRPOAdvantage", "RLOOAdvantage", "ReinforcePlusPlusAdvantage"]
GROUP_ADVANTAGES = [GRPOAdvantage, RLOOAdvantage, ReinforcePlusPlusAdvantage]


@pytest.mark.parametrize("cls", GROUP_ADVANTAGES)
@pytest.mark.parametrize(
    ("rewards", "num_generations", "message"),
    [
        ([1.0, 0.0, 1.0], 2, "3 rewards cannot be split into groups of num_generations=2"),
        ([1.0, float("nan"), 0.0, 1.0], 2, r"rewards\[1\] is nan: every entry must be finite"),
        ([1.0, 0.0, float("inf"), 1.0], 2, r"rewards\[2\] is inf"),
        ([1.0, 0.0], 0, "num_generations must be an int >= "),
        ([1.0, 0.0], 2.0, "num_generations must be an int >= "),
        ([1.0, 0.0], True, "num_generations must be an int >= "),
        ([], 2, "rewards is empty"),
        ([[1.0, 0.0]], 2, r"rewards must be 1-D .* got shape \(1, 2\)"),
        (["high", "low"], 2, "rewards must be a list of numbers"),
    ],
)
def test_group_advantages_reject_bad_batches(cls, rewards, num_generations, message):
    with pytest.raises(InvalidInputError, match=message):
        cls()(rewards, num_generations=num_generations)


def test_option_errors():
    with pytest.raises(InvalidInputError, match=r"scale must be one of \('group', 'batch', 'none'\), got 'std'"):
        GRPOAdvantage()([1.0, 0.0], num_generations=2, scale="std")
    with pytest.raises(InvalidInputError, match="group_layout must be one of"):
        GRPOAdvantage(group_layout="prompt-major")
    with pytest.raises(InvalidInputError, match="group_layout must be one of"):
        RLOOAdvantage()([1.0, 0.0], num_generations=2, group_layout="strided")
    with pytest.raises(InvalidInputError, match=r"eps must be a number in \(0.0, inf\]"):
        GRPOAdvantage()([1.0, 0.0], num_generations=2, eps=0)
    with pytest.raises(InvalidInputError, match="num_generations must be an int >= 2"):
        RLOOAdvantage()([1.0, 0.0], num_generations=1)
    with pytest.raises(InvalidInputError, match=r"gamma must be a number in \[0.0, 1.0\], got 1.5"):
        GAEAdvantage(gamma=1.5)
    with pytest.raises(InvalidInputError, match="lam must be a number"):
        GAEAdvantage(lam=-0.1)


@pytest.mark.parametrize(
    ("rewards", "values", "masks", "message"),
    [
        ([1.0], [[0.1], [0.2]], None, "rewards has 1 samples but values has 2"),
        ([1.0, 1.0], [[0.1], [0.2]], [[1]], "masks has 1 samples but values has 2"),
        ([1.0], [[0.1, 0.2]], [[1, 1, 1]], r"masks\[0\] has 3 entries but values\[0\] has 2"),
        ([[1.0, 0.0, 0.0]], [[0.1, 0.2]], None, r"rewards\[0\] has 3 entries but values\[0\] has 2"),
        ([1.0], [[0.1, 0.2]], [[1, 2]], r"masks\[0\] must hold only 0 and 1"),
        ([1.0], [[0.1, 0.2]], [[0, 0]], r"masks\[0\] selects no token"),
        ([1.0], [[0.1, float("nan")]], None, r"values\[0\]\[1\] is nan"),
        ([float("inf")], [[0.1]], None, r"rewards\[0\] is inf: it must be finite"),
        (["good"], [[0.1]], None, r"rewards\[0\] must be a list of numbers"),
        ([1.0], [[]], None, r"values\[0\] is empty"),
        ([], [], None, "values is empty"),
        ([1.0], 0.5, None, "values must be a list with one entry per sample, got float"),
    ],
)
def test_gae_rejects_mismatched_inputs(rewards, values, masks, message):
    with pytest.raises(InvalidInputError, match=message):
        GAEAdvantage()(rewards, values, masks)


def test_builtins_resolve_by_name_and_entry_point():
    published = {ep.name: ep for ep in entry_points(group="twinkle.advantage")}
    assert set(BUILTINS) <= set(published)
    for name in BUILTINS:
        assert published[name].load() is get_registry("advantage").get(name)
        assert isinstance(build("advantage", name), Advantage)
    configured = build("advantage", "GRPOAdvantage", scale="none", group_layout="interleaved")
    assert (configured.scale, configured.group_layout) == ("none", "interleaved")


def test_import_needs_no_torch():
    code = "import sys, twinkle.advantage\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True)
