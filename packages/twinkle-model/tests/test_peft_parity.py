"""A saved adapter is plain PEFT: loaded with transformers + peft it gives Twinkle's logits."""

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from twinkle.model import TransformersModel


def _trained_model(lora_config, features, steps=3):
    torch.manual_seed(0)
    model = TransformersModel(device="cpu")
    model.add_adapter_to_model("default", lora_config)
    model.set_optimizer("AdamW", lr=1e-2)
    for _ in range(steps):
        model.forward_backward(inputs=features[:4])
        model.clip_grad_and_step()
    return model


def test_saved_adapter_gives_equal_logits_in_plain_peft(lora_config, sft_features, tmp_path):
    model = _trained_model(lora_config, sft_features)
    path = model.save("ckpt", output_dir=tmp_path)
    ours = model.forward_only(inputs=sft_features[4:6], return_logits=True)

    base = AutoModelForCausalLM.from_pretrained(model.model_path, dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, path).eval()
    for feature, logits, logps in zip(sft_features[4:6], ours.logits, ours.logps, strict=True):
        ids = torch.tensor([feature["input_ids"]])
        with torch.no_grad():
            reference = plain(input_ids=ids).logits[0].float()
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
        # logps[t] is log p(token t | < t) on supervised positions.
        labels = torch.tensor(feature["labels"])
        reference_logps = torch.log_softmax(reference[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        supervised = labels[1:] != -100
        # Values near -16: fp32 log-softmax agrees to a few ulp, i.e. relative 1e-5.
        torch.testing.assert_close(logps[1:][supervised], reference_logps[supervised], atol=1e-5, rtol=1e-5)


def test_training_changed_the_adapter(lora_config, sft_features):
    model = _trained_model(lora_config, sft_features, steps=1)
    lora_b = [p for n, p in model.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero; one step moves it
