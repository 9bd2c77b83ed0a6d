"""Seeding and determinism for every RNG a training run touches.

torch and numpy are optional here: ``twinkle-core`` must work without them, and
they are seeded only when already installed.
"""

from __future__ import annotations

import importlib.util
import os
import random


def seed_everything(seed: int, full_determinism: bool = False) -> None:
    """Seed Python, numpy and torch (CPU and CUDA) RNGs.

    ``full_determinism`` additionally asks torch for deterministic kernels, which
    is slower on GPU but makes runs bit-reproducible.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        np.random.seed(seed % 2**32)
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.manual_seed(seed)
        if full_determinism:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
