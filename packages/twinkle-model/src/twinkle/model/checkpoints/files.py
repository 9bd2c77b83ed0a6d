"""Atomic checkpoint directories and the small state files inside them.

A checkpoint is written into a temporary sibling directory and renamed into
place only when complete, so a crash mid-save never leaves a directory that
looks like a finished checkpoint (an existing one is replaced, not mixed).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "twinkle_state.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng_state.pt"


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``final`` on success and vanishes on error."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for path in tmp.iterdir():  # data on disk before the rename makes it visible
            if path.is_file():
                with open(path, "rb") as handle:
                    os.fsync(handle.fileno())
        if final.exists():
            trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (dropout, shuffling, sampling)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
