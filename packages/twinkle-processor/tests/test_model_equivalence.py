"""A forward on a collated batch gives each sequence the logits it gets alone (builtin Qwen3, sdpa and eager)."""

import pytest
import torch

from twinkle.processor import InputProcessor, model_inputs, unpack


def _alone(model, features) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([f["input_ids"]]), use_cache=False).logits[0] for f in features]


def _collated(model, batch, **overrides) -> list[torch.Tensor]:
    with torch.no_grad():
        logits_BTV = model(**{**model_inputs(batch), **overrides}).logits
    return unpack(logits_BTV, batch)


@pytest.mark.parametrize(
    "processor",
    [InputProcessor(padding_free=True), InputProcessor(padding_side="right"), InputProcessor(padding_side="left")],
    ids=["packed", "right", "left"],
)
def test_collated_logits_equal_per_sequence_logits(qwen3_tiny, text_features, processor):
    processor.pad_token_id = qwen3_tiny.config.pad_token_id

    expected = _alone(qwen3_tiny, text_features)
    actual = _collated(qwen3_tiny, processor(text_features))

    assert [len(t) for t in actual] == [len(f["input_ids"]) for f in text_features]
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pitfall", ["kv-cache", "all-ones-mask"])
def test_packing_breaks_with_a_cache_or_a_mask(qwen3_tiny, text_features, pitfall):
    """Why ``model_inputs`` passes ``use_cache=False`` and no mask: either lets packed sequences see each other."""
    batch = InputProcessor(padding_free=True)(text_features)
    override = {"use_cache": True} if pitfall == "kv-cache" else {"attention_mask": torch.ones_like(batch["input_ids"])}

    expected = _alone(qwen3_tiny, text_features)
    actual = _collated(qwen3_tiny, batch, **override)

    torch.testing.assert_close(actual[0], expected[0], atol=1e-5, rtol=0)  # the first sequence sees nothing else
    assert (actual[1] - expected[1]).abs().max() > 1e-2  # later ones attend to the sequences before them
