import json

import pytest
import yaml

from twinkle.errors import ConfigurationError
from twinkle.recipes import sft
from twinkle.recipes.config import load_config


def _config(tmp_path, argv=(), **yaml_values):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(yaml_values))
    return load_config(sft.SFTConfig, ["--config", str(path), *argv], prog="twinkle sft", description="")


def test_defaults_then_yaml_then_flags(tmp_path):
    config = _config(tmp_path, ["--lr", "1e-4", "--lora", "{r: 4, target_modules: all-linear}"], lr=1e-3, epochs=3)
    assert config.lr == 1e-4  # flag beats YAML
    assert config.epochs == 3  # YAML beats default
    assert config.batch_size == 8  # default
    assert config.lora == {"r": 4, "target_modules": "all-linear"}
    assert _config(tmp_path, ["--lora", "null"]).lora is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("lr: [1, 2", "not valid YAML"),
        ("- a\n- b", "must hold a mapping"),
        ("learning_rate: 0.1", r"unknown option\(s\) \['learning_rate'\]"),
        ("epochs: 0", "epochs must be a positive integer"),
        ("lr: -1", "lr must be a positive number"),
    ],
)
def test_bad_config_files(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigurationError, match=message):
        load_config(sft.SFTConfig, ["--config", str(path)], prog="twinkle sft", description="")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigurationError, match="does not exist"):
        load_config(sft.SFTConfig, ["--config", str(tmp_path / "nope.yaml")], prog="twinkle sft", description="")


@pytest.fixture
def small_dataset(tmp_path):
    """Twelve self-cognition rows: three batches of four per epoch."""
    rows = [
        {"query": f"Question {i}: who are you?", "response": f"I am {{{{NAME}}}}, made by {{{{AUTHOR}}}} ({i})."}
        for i in range(12)
    ]
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return str(path)


def test_cli_trains_saves_and_resumes_exactly(tmp_path, small_dataset):
    """`twinkle sft` end to end; resuming from the epoch-1 checkpoint replays epoch 2 exactly."""
    common = {
        "dataset": small_dataset,
        "max_length": 64,
        "batch_size": 4,
        "epochs": 2,
        "lr": 5e-3,
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.1},
    }
    full = sft.run(sft.SFTConfig(**common, output_dir=str(tmp_path / "full")))
    assert len(full["losses"]) == 6 and full["losses"][-1] < full["losses"][0]
    resumed = sft.run(
        sft.SFTConfig(**common, output_dir=str(tmp_path / "resumed"), resume_from=str(tmp_path / "full" / "epoch-1"))
    )
    assert resumed["losses"] == full["losses"][3:]
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert (
        summary["checkpoint"].endswith("epoch-2") and (tmp_path / "full" / "epoch-2" / "adapter_config.json").is_file()
    )


def test_main_prints_a_summary(tmp_path, small_dataset, capsys):
    argv = [
        "--dataset",
        small_dataset,
        "--epochs",
        "1",
        "--output-dir",
        str(tmp_path),
        "--lora",
        "null",
        "--lr",
        "1e-4",
    ]
    assert sft.main(argv) == 0
    out = capsys.readouterr().out
    assert "trained 2 steps" in out and "checkpoint:" in out
    assert (tmp_path / "epoch-1" / "config.json").is_file()  # full-parameter run: a transformers directory
