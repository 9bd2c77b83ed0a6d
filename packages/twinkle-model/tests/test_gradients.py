"""Micro-batching and accumulation give the gradients of one big-batch step."""

import pytest
import torch

from twinkle.model import TransformersModel


def _grads(model):
    return {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}


def _fresh(lora_config, **adapter_kwargs):
    torch.manual_seed(0)
    model = TransformersModel(device="cpu")
    model.add_adapter_to_model("default", lora_config, **adapter_kwargs)
    # Make B non-zero so gradients reach A too.
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("reduction", ["token_mean", "token_sum", "sequence_mean"])
def test_micro_batches_equal_one_big_batch(lora_config, sft_features, reduction):
    big = _fresh(lora_config)
    big.set_loss("CrossEntropyLoss", reduction=reduction)
    big_out = big.forward_backward(inputs=sft_features[:8])
    small = _fresh(lora_config)
    small.set_loss("CrossEntropyLoss", reduction=reduction)
    small_out = small.forward_backward(inputs=sft_features[:8], micro_batch_size=3)
    assert small_out.loss == pytest.approx(big_out.loss, rel=1e-6, abs=1e-5)
    big_grads, small_grads = _grads(big), _grads(small)
    assert big_grads.keys() == small_grads.keys() and big_grads
    for name in big_grads:
        torch.testing.assert_close(small_grads[name], big_grads[name], atol=1e-5, rtol=1e-5)


def test_accumulation_over_calls_equals_one_big_batch(lora_config, sft_features):
    """With a per-sequence mean, two accumulated halves equal the whole batch."""
    big = _fresh(lora_config)
    big.set_loss("CrossEntropyLoss", reduction="sequence_mean")
    big.forward_backward(inputs=sft_features[:8])
    accumulated = _fresh(lora_config, gradient_accumulation_steps=2)
    accumulated.set_loss("CrossEntropyLoss", reduction="sequence_mean")
    accumulated.set_optimizer("SGD", lr=0.1)
    accumulated.forward_backward(inputs=sft_features[:4])
    assert accumulated.clip_grad_and_step(max_grad_norm=1e9) == {"stepped": False, "accumulated": 1}
    accumulated.forward_backward(inputs=sft_features[4:8], micro_batch_size=2)
    for name, grad in _grads(big).items():
        torch.testing.assert_close(_grads(accumulated)[name], grad, atol=1e-5, rtol=0)
    assert accumulated.clip_grad_and_step(max_grad_norm=1e9)["stepped"] is True
    assert not _grads(accumulated)  # zeroed after the step


def test_fine_grained_calls_equal_forward_backward(lora_config, sft_features):
    fused = _fresh(lora_config)
    fused_out = fused.forward_backward(inputs=sft_features[:4])
    manual = _fresh(lora_config)
    output = manual.forward(inputs=sft_features[:4])
    assert output.logps.requires_grad
    loss = manual.calculate_loss()
    manual.backward()
    assert float(loss.loss.detach()) == pytest.approx(fused_out.loss, abs=1e-6)
    for name, grad in _grads(fused).items():
        torch.testing.assert_close(_grads(manual)[name], grad, atol=1e-6, rtol=0)


def test_padding_free_gives_the_same_gradients(lora_config, sft_features):
    padded = _fresh(lora_config)
    padded.forward_backward(inputs=sft_features[:6])
    packed = _fresh(lora_config)
    packed.set_processor("InputProcessor", padding_free=True)
    packed.forward_backward(inputs=sft_features[:6])
    for name, grad in _grads(padded).items():
        torch.testing.assert_close(_grads(packed)[name], grad, atol=1e-5, rtol=0)
