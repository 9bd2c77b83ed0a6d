import sys
import types
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from twinkle.errors import InvalidInputError, MissingDependencyError, ResourceNotFoundError
from twinkle.hub import resolve_dataset, resolve_model


@pytest.fixture
def fake_hf(monkeypatch, tmp_path):
    """Replace the HF download with one that records its arguments and returns a local snapshot."""
    calls = []

    def snapshot_download(repo_id, repo_type):
        calls.append((repo_id, repo_type))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


@pytest.fixture
def fake_modelscope(monkeypatch, tmp_path):
    """Install a stand-in ``modelscope`` module exposing the two download functions Twinkle calls."""
    calls = []
    module = types.ModuleType("modelscope")
    module.snapshot_download = lambda repo_id: calls.append(("model", repo_id)) or str(tmp_path)
    module.dataset_snapshot_download = lambda repo_id: calls.append(("dataset", repo_id)) or str(tmp_path)
    monkeypatch.setitem(sys.modules, "modelscope", module)
    return module, calls


def test_local_model_directory_is_returned_as_given(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "my-model").mkdir()
    assert resolve_model("~/my-model") == str(tmp_path / "my-model")


def test_model_must_be_a_directory(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ResourceNotFoundError, match=r"config\.json"):
        resolve_model(str(weights))


def test_local_dataset_file_and_directory_are_returned(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    assert resolve_dataset(str(data)) == str(data)
    assert resolve_dataset(str(tmp_path)) == str(tmp_path)


def test_missing_local_path_says_what_to_pass(tmp_path):
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(ResourceNotFoundError) as info:
        resolve_model(missing)
    assert missing in str(info.value)
    assert "local path" in str(info.value) and "builtin://qwen3-tiny" in str(info.value)


@pytest.mark.parametrize("model_id", [None, ""])
def test_no_model_id_means_the_builtin_default(model_id, tiny_model_dir):
    assert resolve_model(model_id) == str(tiny_model_dir)


def test_builtin_dataset_resolves_to_its_cache_directory(session_cache):
    path = Path(resolve_dataset("builtin://gsm8k-mini"))
    assert path == session_cache / "builtin" / "gsm8k-mini-v1"
    assert sorted(p.name for p in path.iterdir()) == ["test.jsonl", "train.jsonl"]


def test_unknown_builtin_lists_the_builtins():
    with pytest.raises(ResourceNotFoundError, match="builtin://self-cognition"):
        resolve_dataset("builtin://squad")


def test_dataset_id_is_not_a_model():
    with pytest.raises(ResourceNotFoundError, match="not a model"):
        resolve_model("builtin://gsm8k-mini")


@pytest.mark.parametrize("bad", ["", None])
def test_dataset_id_is_required(bad):
    with pytest.raises(InvalidInputError, match="builtin://gsm8k-mini"):
        resolve_dataset(bad)


def test_non_string_id_is_invalid():
    with pytest.raises(InvalidInputError, match="must be a string"):
        resolve_model(42)


def test_unknown_scheme_lists_the_supported_forms():
    with pytest.raises(ResourceNotFoundError, match=r"hf://org/name.*ms://org/name"):
        resolve_model("s3://bucket/model")


def test_scheme_without_repository_is_invalid():
    with pytest.raises(InvalidInputError, match="names no repository"):
        resolve_model("hf://")


def test_hf_ids_download_model_and_dataset_repos(fake_hf, tmp_path):
    assert resolve_model("hf://Qwen/Qwen3-0.6B") == str(tmp_path)
    assert resolve_dataset("hf://openai/gsm8k") == str(tmp_path)
    assert fake_hf == [("Qwen/Qwen3-0.6B", "model"), ("openai/gsm8k", "dataset")]


def test_bare_org_name_is_read_as_hf(fake_hf, tmp_path):
    assert resolve_model("Qwen/Qwen3-0.6B") == str(tmp_path)
    assert fake_hf == [("Qwen/Qwen3-0.6B", "model")]


def test_offline_hf_download_names_the_id_and_the_local_path_way_out(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ResourceNotFoundError) as info:
        resolve_model("hf://twinkle-tests/not-a-real-model")
    message = str(info.value)
    assert "hf://twinkle-tests/not-a-real-model" in message
    assert "pass its local directory" in message and "resolve_model('/path/to/not-a-real-model')" in message
    assert isinstance(info.value.__cause__, LocalEntryNotFoundError)


def test_offline_bare_id_explains_it_was_not_a_local_path(monkeypatch):
    def offline(repo_id, repo_type):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ResourceNotFoundError) as info:
        resolve_dataset("my-org/my-data")
    assert "'my-org/my-data' is not an existing local path" in str(info.value)
    assert "local file or directory" in str(info.value)
    assert isinstance(info.value.__cause__, LocalEntryNotFoundError)


def test_ms_without_modelscope_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "modelscope", None)  # makes ``import modelscope`` fail
    with pytest.raises(MissingDependencyError, match=r"twinkle-hub\[modelscope\]"):
        resolve_model("ms://Qwen/Qwen3-0.6B")


def test_ms_ids_use_the_model_and_dataset_downloads(fake_modelscope, tmp_path):
    _, calls = fake_modelscope
    assert resolve_model("ms://Qwen/Qwen3-0.6B") == str(tmp_path)
    assert resolve_dataset("ms://swift/self-cognition") == str(tmp_path)
    assert calls == [("model", "Qwen/Qwen3-0.6B"), ("dataset", "swift/self-cognition")]


def test_ms_failures_become_resource_not_found(fake_modelscope):
    module, _ = fake_modelscope

    def unreachable(repo_id):
        raise ConnectionError("modelscope.cn unreachable")

    module.snapshot_download = unreachable
    with pytest.raises(ResourceNotFoundError, match=r"ms://Qwen/Qwen3-0\.6B.*ModelScope.*unreachable"):
        resolve_model("ms://Qwen/Qwen3-0.6B")
