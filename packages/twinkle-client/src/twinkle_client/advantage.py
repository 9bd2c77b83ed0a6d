"""Advantages, computed locally with numpy: the same classes as ``twinkle.advantage``."""

from twinkle.advantage import *  # noqa: F403
from twinkle.advantage import __all__  # noqa: F401
