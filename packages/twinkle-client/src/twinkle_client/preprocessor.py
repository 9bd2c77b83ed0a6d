"""Preprocessors: the classes of ``twinkle.preprocessor``; ``Dataset.map`` rebuilds an instance on the server."""

from twinkle.preprocessor import *  # noqa: F403
from twinkle.preprocessor import __all__  # noqa: F401
