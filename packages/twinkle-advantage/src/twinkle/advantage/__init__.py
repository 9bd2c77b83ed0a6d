"""Advantages: rewards (and values) to the per-sample or per-token weights a policy loss multiplies.

Every class implements :class:`twinkle.interfaces.Advantage` and is registered
under its class name (entry-point group ``twinkle.advantage``). Inputs are
lists, numpy arrays or CPU tensors; results are float32 numpy arrays, so a
client without torch can compute advantages and send them as lists.
"""

from twinkle.advantage.gae import GAEAdvantage
from twinkle.advantage.grouping import GROUP_LAYOUTS, GroupAdvantage, GroupLayout, from_groups, to_groups
from twinkle.advantage.grpo import SCALES, GRPOAdvantage
from twinkle.advantage.reinforce_plus_plus import ReinforcePlusPlusAdvantage
from twinkle.advantage.rloo import RLOOAdvantage

__all__ = [
    "GROUP_LAYOUTS",
    "SCALES",
    "GAEAdvantage",
    "GRPOAdvantage",
    "GroupAdvantage",
    "GroupLayout",
    "RLOOAdvantage",
    "ReinforcePlusPlusAdvantage",
    "from_groups",
    "to_groups",
]
