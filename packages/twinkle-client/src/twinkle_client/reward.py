"""Rewards, scored locally (``twinkle-reward`` needs no torch): the same classes as ``twinkle.reward``."""

from twinkle.reward import *  # noqa: F403
from twinkle.reward import __all__  # noqa: F401
