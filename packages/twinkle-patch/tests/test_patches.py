"""Patches apply, undo exactly, refuse what they are not for, and fix what they say."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.patch import FusedLinearLogpsPatch, applied_patches, apply_patch, patched, remove_patch
from twinkle.template import Template

ANSWER = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


@pytest.fixture(scope="module")
def template() -> Template:
    return Template()


def test_qwen3_template_patch_stops_training_the_empty_think_block(template: Template) -> None:
    before = template.encode({"messages": ANSWER})
    assert "<think>" in template.decode(before["input_ids"])
    with patched(template, "Qwen3ThinkingTemplatePatch"):
        assert applied_patches(template) == ["Qwen3ThinkingTemplatePatch"]
        text = template.decode(template.encode({"messages": ANSWER})["input_ids"])
        assert "<think>" not in text and text.endswith("Hello!<|im_end|>\n")
    assert applied_patches(template) == []
    assert template.encode({"messages": ANSWER})["input_ids"] == before["input_ids"]
    assert not hasattr(template, "_twinkle_patches")


def test_qwen3_template_patch_makes_thinking_off_prefix_stable(template: Template) -> None:
    off = Template(enable_thinking=False)
    conversation = [*ANSWER, {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Bye."}]
    apply_patch(off, "Qwen3ThinkingTemplatePatch")
    feature = off.encode({"messages": conversation})
    text = off.decode(feature["input_ids"])
    assert text.count("<think>\n\n</think>\n\n") == 2  # before every turn, as the generation prompt puts it
    trained = off.decode([t for t, label in zip(feature["input_ids"], feature["labels"], strict=True) if label != -100])
    assert "<think>" not in trained and "Hello!" in trained and "Bye." in trained
    remove_patch(off)
    assert applied_patches(off) == []


def test_a_patch_for_another_family_is_refused(template: Template) -> None:
    tokenizer = template.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    try:
        with pytest.raises(ConfigurationError, match="fixes Qwen3's chat template"):
            apply_patch(tokenizer, "Qwen3ThinkingTemplatePatch")
        assert applied_patches(tokenizer) == []
    finally:
        tokenizer.chat_template = original
    with pytest.raises(ConfigurationError, match="causal LM"):
        apply_patch(torch.nn.Linear(2, 2), FusedLinearLogpsPatch)


def test_fused_logps_patch_gives_the_model_loss_without_logits_and_comes_off_bit_identical() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float64)
    input_ids = torch.randint(0, 1000, (2, 12))
    labels = input_ids.clone()
    labels[0, :5] = -100
    expected = model(input_ids, labels=labels)
    expected.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with patched(model, FusedLinearLogpsPatch()):
        fused = model(input_ids, labels=labels)
        assert fused.logits is None
        fused.loss.backward()
        # transformers computes its loss in float32 (from float64 logits here): its rounding bounds the match.
        assert torch.allclose(fused.loss.double(), expected.loss.double(), rtol=1e-5)
        for name, param in model.named_parameters():
            scale = grads[name].abs().max().item()
            assert (param.grad - grads[name]).abs().max().item() <= 1e-4 * scale + 1e-12, name
        assert torch.equal(model(input_ids).logits, expected.logits)  # without labels: the model's own forward
        with pytest.raises(ConfigurationError, match="already applied"):
            apply_patch(model, "FusedLinearLogpsPatch")
    assert "forward" not in model.__dict__ and not hasattr(model, "_twinkle_patches")
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    assert torch.equal(model(input_ids, labels=labels).logits, expected.logits)


def test_patches_come_off_newest_first(template: Template) -> None:
    class Marker(FusedLinearLogpsPatch):
        name = "Marker"

        def check(self, target: object) -> None:
            pass

        def apply(self, target: object):  # type: ignore[no-untyped-def]
            return lambda: None

    apply_patch(template, "Qwen3ThinkingTemplatePatch")
    apply_patch(template, Marker())
    with pytest.raises(ConfigurationError, match="remove it first"):
        remove_patch(template, "Qwen3ThinkingTemplatePatch")
    remove_patch(template)
    assert applied_patches(template) == []
