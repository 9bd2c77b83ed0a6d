"""The interface of every component kind. A user's own component implements one of these.

ABCs are used where Twinkle provides shared behaviour or wants an explicit
opt-in (``Preprocessor``, ``Loss``, ``Metric``, ``Reward``, ``Advantage``, ``Env``);
``Protocol`` where any object with the right methods will do. Optimizers and
LR schedulers are torch's own classes (``torch.optim``), so they have none here. ``Kernel`` and
``Patch`` are implemented by the ``twinkle-kernels`` and ``twinkle-patch`` distributions.
"""

from twinkle.interfaces.acceleration import Kernel, Patch
from twinkle.interfaces.data import DataLoader, InputProcessor, Preprocessor, SizedDataset, Template, ToolCallParser
from twinkle.interfaces.env import Env, EnvStep
from twinkle.interfaces.rl import Advantage, CheckpointEngine, Reward, Sampler
from twinkle.interfaces.training import Loss, Metric, Model

__all__ = [
    "Advantage",
    "CheckpointEngine",
    "DataLoader",
    "Env",
    "EnvStep",
    "InputProcessor",
    "Kernel",
    "Loss",
    "Metric",
    "Model",
    "Patch",
    "Preprocessor",
    "Reward",
    "Sampler",
    "SizedDataset",
    "Template",
    "ToolCallParser",
]
