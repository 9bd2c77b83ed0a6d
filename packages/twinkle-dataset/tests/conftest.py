"""Fixtures shared by the dataset tests: a private Twinkle cache, small data files, a tokenizer-backed template."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import datasets
import pytest

from twinkle.errors import InvalidInputError

datasets.disable_progress_bars()


@pytest.fixture(scope="session", autouse=True)
def twinkle_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build the builtin model and datasets once per session, outside the user's cache."""
    os.environ.setdefault("TWINKLE_CACHE_DIR", str(tmp_path_factory.mktemp("twinkle-cache")))


@pytest.fixture
def load_kwargs(tmp_path: Path) -> dict[str, Any]:
    """A private ``datasets`` cache per test, so cache hits in one test never come from another."""
    return {"cache_dir": str(tmp_path / "hf-cache")}


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    def write(rows: Iterable[Mapping[str, Any]], name: str = "train.jsonl") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        return path

    return write


def self_cognition(row: Mapping[str, Any]) -> dict[str, Any]:
    """What ``SelfCognitionProcessor('Twinkle', 'ModelScope')`` does, without depending on that package."""
    if not row["query"] or not row["response"]:
        raise InvalidInputError("empty query or response")

    def fill(text: str) -> str:
        return text.replace("{{NAME}}", "Twinkle").replace("{{AUTHOR}}", "ModelScope")

    return {
        "messages": [
            {"role": "user", "content": fill(row["query"])},
            {"role": "assistant", "content": fill(row["response"])},
        ],
        "user_data": {"tag": row["tag"]},
    }


@pytest.fixture
def self_cognition_fn() -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    return self_cognition
