"""Data formats shared with the server: the same types as ``twinkle.data_format``."""

from twinkle.data_format import *  # noqa: F403
from twinkle.data_format import __all__  # noqa: F401
