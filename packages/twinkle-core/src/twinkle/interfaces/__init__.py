"""The interface of every component kind. A user's own component implements one of these.

ABCs are used where Twinkle provides shared behaviour or wants an explicit
opt-in (``Preprocessor``, ``Loss``, ``Metric``, ``Reward``, ``Advantage``);
``Protocol`` where any object with the right methods will do.
"""

from twinkle.interfaces.data import InputProcessor, Preprocessor, SizedDataset, Template
from twinkle.interfaces.infra import Kernel, Store
from twinkle.interfaces.rl import Advantage, CheckpointEngine, Reward, Sampler
from twinkle.interfaces.training import Loss, Metric, Model

__all__ = [
    "Advantage",
    "CheckpointEngine",
    "InputProcessor",
    "Kernel",
    "Loss",
    "Metric",
    "Model",
    "Preprocessor",
    "Reward",
    "Sampler",
    "SizedDataset",
    "Store",
    "Template",
]
