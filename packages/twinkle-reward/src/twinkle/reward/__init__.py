"""Rewards: score sampled completions, one float per trajectory.

Every class implements :class:`twinkle.interfaces.Reward` and is registered
under its class name (entry-point group ``twinkle.reward``). A trajectory is
any mapping with ``messages`` (the trailing assistant message is the
completion) or a ``completion`` string, plus ``user_data`` with the ground
truth, e.g. the ``new_input_feature`` of each sampled sequence. This package
imports neither torch nor numpy, so a remote client can score locally.
"""

from twinkle.reward.answers import (
    boxed_answer,
    first_number,
    hash_answer,
    normalize_answer,
    parse_number,
    same_answer,
    stated_answer,
)
from twinkle.reward.base import CompletionReward, completion_text, user_data_of
from twinkle.reward.function import FunctionReward, reward
from twinkle.reward.gsm8k import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.reward.math_answer import MathAnswerReward, final_answer
from twinkle.reward.short_answer import ShortAnswerReward

__all__ = [
    "CompletionReward",
    "FunctionReward",
    "GSM8KAccuracyReward",
    "GSM8KFormatReward",
    "MathAnswerReward",
    "ShortAnswerReward",
    "boxed_answer",
    "completion_text",
    "final_answer",
    "first_number",
    "hash_answer",
    "normalize_answer",
    "parse_number",
    "reward",
    "same_answer",
    "stated_answer",
    "user_data_of",
]
