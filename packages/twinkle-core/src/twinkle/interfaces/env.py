"""Interface of environments for multi-turn RL: ``Env``, one episode of a task, and ``EnvStep``, a turn's answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from twinkle.data_format import Message, Tool


@dataclass
class EnvStep:
    """The environment's answer to one assistant turn.

    ``messages`` are appended to the conversation (tool results with role
    ``tool``, feedback with role ``user``) and are never trained; ``reward``
    is added to the episode's; once ``done`` the episode ends.
    """

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """An episode: :meth:`reset` opens the conversation, :meth:`step` answers each assistant turn.

    ``tools`` are offered to the model (OpenAI function layout) and rendered
    by the chat template. An environment is plain Python and holds one
    episode's state; :class:`twinkle.env.EnvGroup` makes the copies a group
    of rollouts needs.
    """

    tools: tuple[Tool, ...] = ()

    @abstractmethod
    def reset(self, seed: int) -> list[Message]:
        """Start an episode of the task drawn by ``seed``; the opening messages (system, user)."""

    @abstractmethod
    def step(self, action: Message) -> EnvStep:
        """Answer ``action``, the assistant's parsed turn (``content`` and ``tool_calls``)."""
