"""``CompletionReward``: the shared loop of every per-completion reward.

A reward sees a batch of trajectories: any mapping with ``messages`` (the
completion is the trailing assistant message) and ``user_data`` (the ground
truth), such as the ``new_input_feature`` dicts a sampler returns. A plain
``completion`` string, when present, is used instead of ``messages``.

The loop validates each trajectory, lets the subclass score it, and checks the
score is a finite number. An error raised while scoring is re-raised naming the
reward and the trajectory's index, so a bad row in a batch of hundreds is found
at once.
"""

from __future__ import annotations

import math
import numbers
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Reward


def completion_text(trajectory: Mapping[str, Any]) -> str:
    """The completion to score: ``trajectory['completion']`` or the trailing assistant message's content.

    Only the *last* message counts: a trajectory whose last message is not from
    the assistant has not been answered yet (``''``), and an assistant turn
    earlier in the prompt (a few-shot example) must never be scored as the answer.
    """
    if "completion" in trajectory:
        completion = trajectory["completion"]
        if not isinstance(completion, str):
            raise InvalidInputError(f"'completion' must be a string, got {type(completion).__name__}")
        return completion
    messages = trajectory.get("messages")
    if messages is None:
        raise InvalidInputError("has no 'messages' or 'completion' key")
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise InvalidInputError(f"'messages' must be a list of messages, got {type(messages).__name__}")
    if not messages or not isinstance(messages[-1], Mapping) or messages[-1].get("role") != "assistant":
        return ""
    content = messages[-1].get("content")
    if not isinstance(content, str):
        raise InvalidInputError(f"the assistant message's content must be a string, got {type(content).__name__}")
    return content


def user_data_of(trajectory: Mapping[str, Any]) -> Mapping[str, Any]:
    """The trajectory's ``user_data`` (ground truth and task data); ``{}`` when absent."""
    user_data = trajectory.get("user_data")
    if user_data is None:
        return {}
    if not isinstance(user_data, Mapping):
        raise InvalidInputError(f"'user_data' must be a dict, got {type(user_data).__name__}")
    return user_data


def required_field(user_data: Mapping[str, Any], key: str) -> Any:
    """``user_data[key]``; a missing ground truth is a data bug, never a reward of 0."""
    if user_data.get(key) is None:
        raise InvalidInputError(f"user_data has no {key!r} (the ground truth); keys: {sorted(user_data)}")
    return user_data[key]


class CompletionReward(Reward):
    """A reward that scores each trajectory on its own (see module docstring).

    Subclasses implement :meth:`score`; one that needs more than the completion
    text and ``user_data`` overrides :meth:`score_trajectory` instead.
    """

    def __call__(self, trajectories: Sequence[Mapping[str, Any]]) -> list[float]:
        name = type(self).__name__
        if not isinstance(trajectories, Sequence) or isinstance(trajectories, (str, bytes, Mapping)):
            raise InvalidInputError(f"{name} expects a list of trajectories, got {type(trajectories).__name__}")
        rewards = []
        for index, trajectory in enumerate(trajectories):
            where = f"{name}: trajectories[{index}]"
            if not isinstance(trajectory, Mapping):
                raise InvalidInputError(
                    f"{where} must be a dict with 'messages' and 'user_data', got {type(trajectory).__name__}"
                )
            try:
                value = self.score_trajectory(trajectory)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{where}: {exc}") from exc
            rewards.append(_finite_float(value, where))
        return rewards

    def score_trajectory(self, trajectory: Mapping[str, Any]) -> float:
        """Score one trajectory; by default :meth:`score` of its completion and ``user_data``."""
        return self.score(completion_text(trajectory), user_data_of(trajectory))

    @abstractmethod
    def score(self, completion: str, user_data: Mapping[str, Any]) -> float:
        """The reward of one completion given its ground truth."""


def _finite_float(value: Any, where: str) -> float:
    if not isinstance(value, numbers.Real):
        raise InvalidInputError(f"{where}: the reward must be a number, got {type(value).__name__} {value!r:.40}")
    result = float(value)
    if not math.isfinite(result):
        raise InvalidInputError(f"{where}: the reward must be finite, got {result}")
    return result
