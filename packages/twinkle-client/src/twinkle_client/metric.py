"""Metrics, accumulated locally with numpy: the same classes as ``twinkle.metric``."""

from twinkle.metric import *  # noqa: F403
from twinkle.metric import __all__  # noqa: F401
