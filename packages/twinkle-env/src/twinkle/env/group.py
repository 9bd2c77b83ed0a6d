"""``EnvGroup``: copies of one task, so that group-relative advantages compare rollouts of the same prompt."""

from __future__ import annotations

from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Env
from twinkle.registry import build


class EnvGroup:
    """``group_size`` episodes of the task drawn by ``seed``.

    ``env`` is an :class:`Env` class, a registered name (``'CalculatorEnv'``)
    or an import path; ``env_kwargs`` configure every copy. Rollouts of a group
    are listed together, which is what ``GRPOAdvantage(...)(rewards,
    num_generations=group_size)`` expects.
    """

    def __init__(self, env: str | type[Env], group_size: int, seed: int, **env_kwargs: Any) -> None:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise InvalidInputError(f"group_size must be a positive int, got {group_size!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidInputError(f"seed must be an int, got {seed!r}")
        self.envs: list[Env] = [build("env", env, **env_kwargs) for _ in range(group_size)]
        for copy in self.envs:
            if not isinstance(copy, Env):
                raise InvalidInputError(f"env must build a twinkle.env.Env, got {type(copy).__name__}")
        self.seed = seed

    def __len__(self) -> int:
        return len(self.envs)
