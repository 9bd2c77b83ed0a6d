"""Checkpoints: exact round trips, atomic writes, and clear errors for bad names and missing state."""

import pytest
import torch

from twinkle.errors import ConfigurationError, ResourceNotFoundError
from twinkle.model import TransformersModel, peft_adapters


def _assert_same_logps(model, other, features):
    for ours, theirs in zip(
        model.forward_only(inputs=features).logps, other.forward_only(inputs=features).logps, strict=True
    ):
        assert torch.equal(ours, theirs)


def _files(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _shift_adapter(model, amount=0.5):
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.add_(amount)


def test_lora_round_trip_reproduces_logps_exactly(new_lora_model, short_features, tmp_path):
    model = new_lora_model()
    path = model.save("lora", output_dir=tmp_path)
    assert path == str(tmp_path / "lora")

    restored = TransformersModel(device="cpu")
    base_logps = restored.forward_only(inputs=short_features).logps
    restored.load(path)
    assert restored.adapter_names == ["default"]
    _assert_same_logps(model, restored, short_features)
    assert not torch.equal(base_logps[0], restored.forward_only(inputs=short_features[:1]).logps[0])


def test_full_parameter_round_trip_reproduces_logps_exactly(short_features, tmp_path):
    model = TransformersModel(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight moves, the tied embedding / output layer included
        for param in model.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    path = model.save("full", output_dir=tmp_path)

    restored = TransformersModel(device="cpu")
    restored.load(path)
    _assert_same_logps(model, restored, short_features)


WRITERS = {"adapter_weights": (peft_adapters, "save_file"), "optimizer_state": (torch, "save")}


@pytest.mark.parametrize("replacing", [False, True], ids=["new", "replacing"])
@pytest.mark.parametrize("writer", WRITERS)
def test_failed_save_leaves_no_partial_checkpoint(new_lora_model, tmp_path, monkeypatch, writer, replacing):
    model = new_lora_model()
    model.set_optimizer("SGD", lr=0.1)
    before = {}
    if replacing:
        before = _files(tmp_path / model.save("ckpt", output_dir=tmp_path, save_optimizer=False))
        _shift_adapter(model)  # the new checkpoint would differ in every file

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(*WRITERS[writer], fail)
    with pytest.raises(OSError, match="disk full"):
        model.save("ckpt", output_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["ckpt"] if replacing else [])  # no temporary directories
    if replacing:
        assert _files(tmp_path / "ckpt") == before


def test_save_replaces_an_existing_checkpoint_without_mixing(new_lora_model, tmp_path):
    model = new_lora_model()
    model.set_optimizer("SGD", lr=0.1)
    path = model.save("ckpt", output_dir=tmp_path)
    assert "optimizer.pt" in _files(tmp_path / "ckpt")
    assert model.save("ckpt", output_dir=tmp_path, save_optimizer=False) == path
    assert "optimizer.pt" not in _files(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("name", ["../escaped", "..", ".", "a/b", "", "/tmp/absolute"])
def test_save_rejects_names_that_are_not_a_plain_directory_name(new_lora_model, tmp_path, name):
    output_dir = tmp_path / "out"
    with pytest.raises(ConfigurationError, match="checkpoint name must be a plain directory name"):
        new_lora_model().save(name, output_dir=output_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_load_of_a_missing_or_foreign_directory_is_resource_not_found(tmp_path):
    model = TransformersModel(device="cpu")
    with pytest.raises(ResourceNotFoundError, match="does not exist"):
        model.load(tmp_path / "missing")
    with pytest.raises(ResourceNotFoundError, match="neither an adapter nor"):
        model.load(tmp_path)
    with pytest.raises(ResourceNotFoundError, match=r"not a checkpoint written by TransformersModel\.save"):
        model.resume_from_checkpoint(tmp_path)


def test_loading_optimizer_state_that_was_not_saved_fails_before_changing_weights(new_lora_model, tmp_path):
    saved = new_lora_model()
    _shift_adapter(saved)
    path = saved.save("weights_only", output_dir=tmp_path, save_optimizer=False)

    model = new_lora_model()
    model.set_optimizer("AdamW", lr=1e-3)
    weights = {n: p.clone() for n, p in model.model.named_parameters() if "lora_" in n}
    for load in (lambda: model.load(path, load_optimizer=True), lambda: model.resume_from_checkpoint(path)):
        with pytest.raises(ResourceNotFoundError, match=r"has no optimizer state \(saved with save_optimizer=False\)"):
            load()
    assert all(torch.equal(p, weights[n]) for n, p in model.model.named_parameters() if "lora_" in n)


def test_loading_optimizer_state_needs_an_optimizer_to_take_it(new_lora_model, tmp_path):
    saved = new_lora_model()
    saved.set_optimizer("AdamW", lr=1e-3)
    saved.set_lr_scheduler("ConstantScheduler")
    path = saved.save("ckpt", output_dir=tmp_path)

    fresh = TransformersModel(device="cpu")
    with pytest.raises(ConfigurationError, match=r"add adapter 'default' and call set_optimizer"):
        fresh.load(path, load_optimizer=True)
    assert fresh.adapter_names == []

    model = new_lora_model()
    with pytest.raises(ConfigurationError, match=r"no optimizer for adapter 'default'"):
        model.load(path, load_optimizer=True)
    model.set_optimizer("AdamW", lr=1e-3)
    with pytest.raises(ConfigurationError, match=r"has LR-scheduler state: call set_lr_scheduler"):
        model.load(path, load_optimizer=True)
    model.set_lr_scheduler("ConstantScheduler")
    model.load(path, load_optimizer=True)
