"""A synced adapter with LoRA on the output layer (``lm_head``) samples with it; a merged sync of a tied one is refused.

``builtin://qwen3-tiny`` ties ``lm_head`` to the input embedding, so the
adapter's output-layer update cannot be merged into the shared weight; synced
as a LoRA adapter, the sampler applies it at every decoding step and to the
prompt's log-probs, per row: rows sampled without the adapter get the base.

Trainer, sampler and reference hold float64 weights; the sampler casts the
logits to float32 for sampling and log-probs, which moves a log-prob of these
magnitudes (|lp| < 20, a logsumexp over 151k logits) by ~1e-6 on any CPU, so
1e-5 bounds it, while a missing output-layer update moves them by > 1e-3.
"""

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import IGNORE_INDEX, SamplingParams, make_input_feature
from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.model import MultiLoraModel, TransformersModel
from twinkle.sampler import TorchSampler

DTYPE = torch.float64  # see the module docstring
TOL = 1e-5
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=0, prompt_logprobs=True)
CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
# PEFT warns that a tied layer is a target; adapting the output projection alone is what is wanted here.
pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")


def _lora_B(model) -> dict[str, torch.Tensor]:
    """The adapter's B matrices by module name (PEFT's parameters, or MultiLoraModel's own)."""
    if isinstance(model, MultiLoraModel):
        tensors = model.lora_payload("policy")[1].items()
    else:
        tensors = ((name.replace(".policy", ""), param) for name, param in model.model.named_parameters())
    return {key.split(".lora_B")[0]: tensor for key, tensor in tensors if ".lora_B" in key}


@pytest.fixture(params=["TransformersModel", "MultiLoraModel"])
def trainer(request):
    torch.manual_seed(0)
    kind = TransformersModel if request.param == "TransformersModel" else MultiLoraModel
    model = kind(device="cpu", dtype=DTYPE)
    model.add_adapter_to_model("policy", CONFIG)
    with torch.no_grad():  # B = 0 would make the adapter the base model
        for index, tensor in enumerate(_lora_B(model).values()):
            tensor.normal_(0, 0.3, generator=torch.Generator().manual_seed(index))
    return model


def _trainer_logps(trainer, sequences):
    """The trainer's log-probs of each sequence's completion tokens and of its prompt tokens after the first."""
    features = [s.new_input_feature for s in sequences]
    logps = trainer.forward_only(inputs=features, adapter_name="policy").logps
    completions = [lp[torch.tensor(f["labels"]) != IGNORE_INDEX] for lp, f in zip(logps, features, strict=True)]
    prompt_features = [
        make_input_feature(f["input_ids"][: _prompt_length(f)], f["input_ids"][: _prompt_length(f)]) for f in features
    ]
    prompts = [lp[1:] for lp in trainer.forward_only(inputs=prompt_features, adapter_name="policy").logps]
    return completions, prompts


def _base_logps(sequences):
    base = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=DTYPE).eval()
    completions, prompts = [], []
    with torch.no_grad():
        for sequence in sequences:
            feature = sequence.new_input_feature
            ids = torch.tensor(feature["input_ids"])
            logprobs = torch.log_softmax(base(input_ids=ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
            completions.append(logprobs[_prompt_length(feature) - 1 :])
            prompts.append(logprobs[: _prompt_length(feature) - 1])
    return completions, prompts


def _prompt_length(feature) -> int:
    return next(i for i, label in enumerate(feature["labels"]) if label != IGNORE_INDEX)


def _gap(got, expected) -> float:
    return max((torch.tensor(g, dtype=DTYPE) - e).abs().max().item() for g, e in zip(got, expected, strict=True))


@pytest.fixture
def sampler(template):
    """A float64 sampler (the package's shared one is float32)."""
    sampler = TorchSampler(device="cpu", dtype=DTYPE)
    sampler.set_template(template)
    return sampler


def test_an_lm_head_adapter_samples_with_its_output_layer_row_by_row(trainer, sampler, prompts):
    CheckpointEngineManager(trainer, sampler).sync_weights()
    adapters = ["policy", None, "policy", None]
    response = sampler.sample(prompts, PARAMS, adapter_name=adapters)
    policy = [s for s, a in zip(response.sequences, adapters, strict=True) if a]
    plain = [s for s, a in zip(response.sequences, adapters, strict=True) if not a]
    policy_prompts = [row[1:] for row, a in zip(response.prompt_logprobs, adapters, strict=True) if a]
    plain_prompts = [row[1:] for row, a in zip(response.prompt_logprobs, adapters, strict=True) if not a]

    completions, prompt_logps = _trainer_logps(trainer, policy)
    assert _gap([s.logprobs for s in policy], completions) <= TOL
    assert _gap(policy_prompts, prompt_logps) <= TOL
    completions, prompt_logps = _base_logps(plain)
    assert _gap([s.logprobs for s in plain], completions) <= TOL
    assert _gap(plain_prompts, prompt_logps) <= TOL

    with torch.no_grad():  # without the output layer's update the trainer's numbers are far from the sampler's
        next(tensor for module, tensor in _lora_B(trainer).items() if module.endswith("lm_head")).zero_()
    completions, prompt_logps = _trainer_logps(trainer, policy)
    assert _gap([s.logprobs for s in policy], completions) > 1e-3
    assert _gap(policy_prompts, prompt_logps) > 1e-3


def test_a_merged_sync_of_a_tied_lm_head_adapter_is_refused(trainer, sampler):
    before = {key: tensor.clone() for key, tensor in sampler.model.state_dict().items()}
    with pytest.raises(ConfigurationError, match=r"adapts lm_head, whose weight is tied .*merge_and_sync=False"):
        CheckpointEngineManager(trainer, sampler).sync_weights(merge_and_sync=True)
    assert all(torch.equal(tensor, before[key]) for key, tensor in sampler.model.state_dict().items())
