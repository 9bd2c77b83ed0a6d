"""Where ``vLLMSampler`` writes adapters it is given as tensors: vLLM loads LoRA only from PEFT directories.

Each sampler owns one directory under the system's temporary directory, named
with its process id. The sampler removes it when it is closed, collected, or
the interpreter exits. A process killed before it could (a Ray actor ended by
``ray.kill``, a SIGKILL) leaves its directory behind; the next sampler started
by the same user on the machine removes the directories of processes that are
gone, so adapters do not pile up in ``/tmp``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from twinkle.module import write_adapter_dir

PREFIX = "twinkle-vllm-adapters-"


class AdapterFiles:
    """A private directory of PEFT adapter directories, one per :meth:`write`."""

    def __init__(self) -> None:
        remove_orphans()
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)

    def write(self, config: Any, state_dict: Mapping[str, torch.Tensor]) -> Path:
        """A new PEFT adapter directory holding ``config`` and ``state_dict``."""
        directory = Path(tempfile.mkdtemp(dir=self.root))
        write_adapter_dir(directory, config, state_dict)
        return directory

    def remove(self, path: str | Path) -> None:
        """Delete ``path`` if :meth:`write` made it; any other directory (the user's own) is left alone."""
        path = Path(path)
        if path.parent == self.root:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Delete the directory and everything in it now (idempotent)."""
        self._finalizer()


def remove_orphans() -> None:
    """Delete this user's adapter directories whose process is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        try:
            mine = path.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile by another process
            continue
        if pid.isdigit() and mine and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
