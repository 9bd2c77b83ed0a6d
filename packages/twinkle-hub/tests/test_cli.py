"""``twinkle download``: the local path of a model or dataset, for tools that take a folder."""

from __future__ import annotations

from pathlib import Path

from twinkle.hub import resolve_model
from twinkle.hub.cli import main


def test_download_prints_the_embedded_model_folder(capsys):
    assert main([]) == 0
    path = capsys.readouterr().out.strip()
    assert path == resolve_model("builtin://qwen3-tiny")
    assert (Path(path) / "tokenizer.json").is_file()


def test_an_unknown_id_fails_with_a_message(capsys):
    assert main(["builtin://no-such-model"]) == 1
    assert "no-such-model" in capsys.readouterr().err
