"""Multi-turn RL: :class:`Env` episodes with tools, :class:`EnvGroup` for group advantages, batched :func:`rollout`."""

from twinkle.env.arithmetic import ExpressionError, evaluate
from twinkle.env.calculator import CALCULATOR_TOOL, CalculatorEnv
from twinkle.env.group import EnvGroup
from twinkle.env.guessing import GuessNumberEnv
from twinkle.env.rollout import Episode, rollout
from twinkle.interfaces import Env, EnvStep

__all__ = [
    "CALCULATOR_TOOL",
    "CalculatorEnv",
    "Env",
    "EnvGroup",
    "EnvStep",
    "Episode",
    "ExpressionError",
    "GuessNumberEnv",
    "evaluate",
    "rollout",
]
