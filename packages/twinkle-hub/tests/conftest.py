"""Shared fixtures: one session cache holding the built-ins, built once and reused by every test."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle.hub import resolve_model


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point TWINKLE_CACHE_DIR at a fresh directory so tests never read or fill the user's cache."""
    cache = tmp_path_factory.mktemp("twinkle-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TWINKLE_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="session")
def tiny_model_dir(session_cache: Path) -> Path:
    return Path(resolve_model("builtin://qwen3-tiny"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def read_jsonl() -> Callable[[Path], list[dict[str, Any]]]:
    def read(path: Path) -> list[dict[str, Any]]:
        with path.open(encoding="utf-8") as file:
            return [json.loads(line) for line in file]

    return read
