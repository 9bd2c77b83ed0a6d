"""Shared by every test in the workspace (pytest loads it for all packages' tests).

- Builtin models and datasets are built once per test session into a temporary
  cache, never into the user's ``~/.cache/twinkle`` (an explicit
  ``TWINKLE_CACHE_DIR`` wins, e.g. to reuse a cache across runs).
- Torch runs on one intra-op thread: the embedded model's matrices are too small
  for threads to pay off, and on a busy two-core machine their synchronisation
  makes steps many times slower.
"""

import importlib.util
import os
import tempfile

import pytest

os.environ.setdefault("TWINKLE_CACHE_DIR", tempfile.mkdtemp(prefix="twinkle-test-cache-"))


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    if importlib.util.find_spec("torch") is None:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
