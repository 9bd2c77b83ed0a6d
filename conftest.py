"""Shared by every test in the workspace (pytest loads it for all packages' tests).

- Builtin models and datasets are built once per test session into a temporary
  cache, removed when the session ends, never into the user's ``~/.cache/twinkle``
  (an explicit ``TWINKLE_CACHE_DIR`` wins, e.g. to reuse a cache across runs).
- Torch runs on one intra-op thread: the embedded model's matrices are too small
  for threads to pay off, and on a busy two-core machine their synchronisation
  makes steps many times slower. Every process a test starts (servers, cookbook
  runs, torchrun workers) inherits ``OMP_NUM_THREADS=1`` for the same reason
  (measured: two cookbook tests side by side took 25% less time).
- Integration tests are collected first: under ``make test``'s workers (a test file
  per worker at a time, in collection order) the long ones start early and the
  many short unit tests fill both workers at the end, instead of one long file
  running alone at the end.
- Hugging Face's ``kernels`` package (a dependency of transformers >= 5.25) is
  imported before any test is collected. pytest's importlib mode names the
  modules of ``kernels/tests/`` (twinkle-kernels' tests) ``kernels.tests.*``
  and, finding no ``kernels`` module yet, registers an empty one under that
  name, which transformers' ``from kernels import ...`` then fails on.
"""

import atexit
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile

import pytest

if "TWINKLE_CACHE_DIR" not in os.environ:  # made here (pytest-xdist's workers inherit it): removed at exit
    os.environ["TWINKLE_CACHE_DIR"] = tempfile.mkdtemp(prefix="twinkle-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TWINKLE_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    importlib.metadata.distribution("kernels")
except importlib.metadata.PackageNotFoundError:
    pass  # transformers < 5.25 does not use it
else:
    importlib.import_module("kernels")


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith("integration-tests/"))  # stable: files stay whole
