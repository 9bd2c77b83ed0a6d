"""Bad input through the GRPO loop: a clear error naming the culprit, and nothing corrupted.

The loop is ``cookbook/rl/grpo.py``'s, built once: a LoRA policy trained with ``GRPOLoss`` and AdamW, a
``TorchSampler`` kept on the policy by ``CheckpointEngineManager``, two gsm8k-mini prompts with two completions
each. Every bad call is made mid-step, where there is most to corrupt: the optimizer has state from a first
step, and the gradients of the second step's first mini-batch (the first prompt's completions) are accumulated.
Afterwards the trainer (weights, gradients, optimizer state, counters, metrics) and the sampler's synced adapter
must be bit-identical, and the rest of the step (resample with the same seed, rewards, advantages, the second
mini-batch, ``clip_grad_and_step``) must give exactly the tokens, loss and weights it gives without the bad call.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig

from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import (
    IGNORE_INDEX,
    InputFeature,
    ModelOutput,
    SampleResponse,
    SamplingParams,
    make_input_feature,
)
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import InvalidInputError
from twinkle.model import TransformersModel
from twinkle.module import multi_lora_modules
from twinkle.preprocessor import GSM8KProcessor
from twinkle.reward import FunctionReward, GSM8KAccuracyReward, GSM8KFormatReward, MathAnswerReward
from twinkle.sampler import TorchSampler

pytestmark = pytest.mark.integration

MODEL_ID = "builtin://qwen3-tiny"
ADAPTER = "default"
NUM_SAMPLES = 2  # completions per prompt; also the mini-batch size: one prompt's group per forward_backward
PARAMS = SamplingParams(max_tokens=4, temperature=1.0, seed=3)


def ascii_share(completion: str, user_data: Mapping[str, Any]) -> float:
    """Share of ASCII characters: it varies between an untrained model's completions, so advantages are not 0."""
    return sum(char.isascii() for char in completion) / max(len(completion), 1)


REWARDS = (GSM8KAccuracyReward(), GSM8KFormatReward(), FunctionReward(ascii_share))


@dataclasses.dataclass
class Batch:
    """One sampling round, as the loop trains on it."""

    response: SampleResponse
    inputs: list[InputFeature]
    old_logps: list[list[float]]
    rewards: list[float]
    advantages: list[float]


@dataclasses.dataclass
class Outcome:
    """What the rest of a step produced: the resampled tokens, the second mini-batch's loss, the new weights."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    loss: float
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


class Loop:
    """The GRPO loop's components, the mid-step state a bad call must leave alone, and its reference outcome."""

    def __init__(self, prompts: list[InputFeature]) -> None:
        self.prompts = prompts
        torch.manual_seed(0)
        self.model = TransformersModel(model_id=MODEL_ID, device="cpu")
        self.model.add_adapter_to_model(ADAPTER, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # LoRA starts as the base model, whose tiny completions all look alike
            for name, param in self.model.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        self.model.set_optimizer("AdamW", lr=1e-2)
        self.model.set_loss("GRPOLoss", epsilon=0.2)
        self.sampler = TorchSampler(model_id=MODEL_ID, device="cpu")
        self.sampler.set_template("Template", enable_thinking=False)
        self.manager = CheckpointEngineManager(model=self.model, sampler=self.sampler)

        # One whole step, then the next one's first mini-batch: the state every test starts from.
        self.manager.sync_weights()
        first = self.sample()
        self.model.forward_backward(inputs=first.inputs, old_logps=first.old_logps, advantages=first.advantages)
        self.model.clip_grad_and_step()
        self.manager.sync_weights()
        self.batch = self.sample()
        self.model.forward_backward(
            inputs=self.batch.inputs[:NUM_SAMPLES],
            old_logps=self.batch.old_logps[:NUM_SAMPLES],
            advantages=self.batch.advantages[:NUM_SAMPLES],
        )
        self.drain_metrics()  # so that a bad call recording anything shows
        self.start = self.trainer_state()
        self.start_adapters = self.sampler_adapters()
        self.reference = self.rest_of_step()
        self.rewind()

    def sample(self, params: SamplingParams = PARAMS) -> Batch:
        """Sample with the synced adapter, score, and compute the GRPO advantages."""
        response = self.sampler.sample(self.prompts, params, adapter_name=ADAPTER, num_samples=NUM_SAMPLES)
        inputs = [sequence.new_input_feature for sequence in response.sequences]
        scores = [reward(inputs) for reward in REWARDS]
        rewards = [sum(row) for row in zip(*scores, strict=True)]
        advantages = GRPOAdvantage()(rewards, num_generations=NUM_SAMPLES).tolist()
        return Batch(response, inputs, [sequence.logprobs for sequence in response.sequences], rewards, advantages)

    def train_rest(self, **overrides: Any) -> ModelOutput:
        """``forward_backward`` on the second mini-batch, any of its arguments replaced."""
        arguments = {
            "inputs": self.batch.inputs[NUM_SAMPLES:],
            "old_logps": self.batch.old_logps[NUM_SAMPLES:],
            "advantages": self.batch.advantages[NUM_SAMPLES:],
            **overrides,
        }
        return self.model.forward_backward(**arguments)

    def rest_of_step(self) -> Outcome:
        """Resample (the same seed must give the same batch), then the second mini-batch and the optimizer step."""
        batch = self.sample()
        output = self.model.forward_backward(
            inputs=batch.inputs[NUM_SAMPLES:],
            old_logps=batch.old_logps[NUM_SAMPLES:],
            advantages=batch.advantages[NUM_SAMPLES:],
        )
        grads = self.trainable_grads()
        self.model.clip_grad_and_step()
        return Outcome(
            tokens=[sequence.tokens for sequence in batch.response.sequences],
            logprobs=[sequence.logprobs for sequence in batch.response.sequences],
            loss=output.loss,
            grads=grads,
            weights={n: p.detach().clone() for n, p in self.model.model.named_parameters() if p.requires_grad},
        )

    def trainable_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.model.model.named_parameters() if p.requires_grad}

    def trainer_state(self) -> dict[str, Any]:
        """Everything a training call may change (the adapter's optimizer and counters have no public accessor)."""
        state = self.model.train_state(ADAPTER)
        parameters = dict(self.model.model.named_parameters())
        return {
            "weights": {n: p.detach().clone() for n, p in parameters.items()},
            "grads": {n: p.grad.clone() for n, p in parameters.items() if p.grad is not None},
            "optimizer": copy.deepcopy(state.optimizer.state_dict()),
            "counters": state.counters(),
        }

    def sampler_adapters(self) -> dict[str, Any]:
        """The LoRA tensors and scaling the sampler serves, per layer and adapter."""
        return {
            f"{module}/{name}": (lora.A_RI.clone(), lora.B_OR.clone(), lora.scaling)
            for module, layer in multi_lora_modules(self.sampler.model).items()
            for name, lora in layer.adapters.items()
        }

    def assert_untouched(self) -> None:
        assert_identical(self.trainer_state(), self.start, "trainer")
        assert_identical(self.sampler_adapters(), self.start_adapters, "sampler adapter")
        for is_training in (True, False):
            assert set(self.model.calculate_metric(is_training=is_training)) <= {"lr", "global_step"}, "metrics"

    def assert_continues_as_reference(self) -> None:
        outcome = self.rest_of_step()
        assert outcome.tokens == self.reference.tokens
        assert outcome.logprobs == self.reference.logprobs
        assert outcome.loss == self.reference.loss
        assert_identical(outcome.weights, self.reference.weights, "weights after the step")

    def rewind(self) -> None:
        """Back to the mid-step state, for the next test (the sampler was synced with its weights)."""
        state = self.model.train_state(ADAPTER)
        with torch.no_grad():
            for name, param in self.model.model.named_parameters():
                param.copy_(self.start["weights"][name])
                grad = self.start["grads"].get(name)
                param.grad = None if grad is None else grad.clone()
        state.optimizer.load_state_dict(copy.deepcopy(self.start["optimizer"]))
        state.global_step = self.start["counters"]["global_step"]
        state.accumulated = self.start["counters"]["accumulated"]
        self.drain_metrics()
        self.manager.sync_weights()

    def drain_metrics(self) -> None:
        for is_training in (True, False):
            self.model.calculate_metric(is_training=is_training)


def assert_identical(before: Any, after: Any, where: str) -> None:
    """Bit-identical tensors (same dtype) in the same nested dicts, lists and tuples."""
    if torch.is_tensor(before):
        same = torch.is_tensor(after) and before.dtype == after.dtype and torch.equal(before, after)
        assert same, where
    elif isinstance(before, Mapping):
        assert isinstance(after, Mapping) and before.keys() == after.keys(), where
        for key in before:
            assert_identical(before[key], after[key], f"{where}[{key!r}]")
    elif isinstance(before, (list, tuple)):
        assert isinstance(after, (list, tuple)) and len(before) == len(after), where
        for index, (old, new) in enumerate(zip(before, after, strict=True)):
            assert_identical(old, new, f"{where}[{index}]")
    else:
        assert before == after, where


def prompt_only(prompt: InputFeature) -> InputFeature:
    """A feature with no completion token: nothing labelled."""
    return make_input_feature(prompt["input_ids"], [IGNORE_INDEX] * len(prompt["input_ids"]))


@pytest.fixture(scope="module")
def built_loop() -> Loop:
    dataset = Dataset(DatasetMeta("builtin://gsm8k-mini", data_slice=range(2)))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256, enable_thinking=False)
    dataset.map(GSM8KProcessor(system=None, include_solution=False))
    dataset.encode(add_generation_prompt=True)
    return Loop([dataset[0], dataset[1]])


@pytest.fixture
def loop(built_loop: Loop) -> Iterator[Loop]:
    """The loop mid-step; whatever a test does to it is undone afterwards."""
    yield built_loop
    built_loop.rewind()


def _replaced(values: list[float], index: int, value: float) -> list[float]:
    return [value if i == index else v for i, v in enumerate(values)]


NAN, INF = float("nan"), float("inf")
# (bad call on the loop, error type, message pattern)
BAD_CALLS: dict[str, tuple[Callable[[Loop], Any], type[Exception], str]] = {
    "fewer_advantages_than_inputs": (
        lambda loop: loop.train_rest(advantages=loop.batch.advantages[NUM_SAMPLES:][:1]),
        InvalidInputError,
        r"loss input 'advantages' has 1 entries but the batch has 2 samples",
    ),
    "more_advantages_than_inputs": (
        lambda loop: loop.train_rest(advantages=[*loop.batch.advantages[NUM_SAMPLES:], 0.0]),
        InvalidInputError,
        r"loss input 'advantages' has 3 entries but the batch has 2 samples",
    ),
    "advantages_array_as_long_as_a_micro_batch": (
        lambda loop: loop.train_rest(advantages=np.asarray(loop.batch.advantages[:1]), micro_batch_size=1),
        InvalidInputError,
        r"loss input 'advantages' has 1 entries but the batch has 2 samples",
    ),
    "advantages_as_one_0d_tensor": (
        lambda loop: loop.train_rest(advantages=torch.tensor(loop.batch.advantages).mean()),
        InvalidInputError,
        r"advantages must have one entry per sample \(2\), got a 0-d Tensor",
    ),
    "old_logps_row_one_short": (
        lambda loop: loop.train_rest(old_logps=[loop.batch.old_logps[2][:-1], loop.batch.old_logps[3]]),
        InvalidInputError,
        r"old_logps\[0\] has \d+ values, but sample 0 has \d+ supervised tokens",
    ),
    "old_logps_row_one_long": (
        lambda loop: loop.train_rest(old_logps=[loop.batch.old_logps[2], [*loop.batch.old_logps[3], -1.0]]),
        InvalidInputError,
        r"old_logps\[1\] has \d+ values, but sample 1 has \d+ supervised tokens",
    ),
    "old_logps_for_fewer_rows": (
        lambda loop: loop.train_rest(old_logps=loop.batch.old_logps[2:3]),
        InvalidInputError,
        r"loss input 'old_logps' has 1 entries but the batch has 2 samples",
    ),
    "old_logps_for_a_row_without_completion": (
        lambda loop: loop.train_rest(
            inputs=[prompt_only(loop.prompts[1]), loop.batch.inputs[3]], old_logps=[[-1.0], loop.batch.old_logps[3]]
        ),
        InvalidInputError,
        r"old_logps\[0\] has 1 values, but sample 0 has 0 supervised tokens",
    ),
    "no_row_with_a_completion_token": (
        lambda loop: loop.train_rest(inputs=[prompt_only(p) for p in loop.prompts], old_logps=[[], []]),
        InvalidInputError,
        r"no supervised token",
    ),
    "nan_advantage": (
        lambda loop: loop.train_rest(advantages=_replaced(loop.batch.advantages[NUM_SAMPLES:], 1, NAN)),
        InvalidInputError,
        r"advantages\[1\] holds nan at position 0",
    ),
    "inf_advantage": (
        lambda loop: loop.train_rest(advantages=_replaced(loop.batch.advantages[NUM_SAMPLES:], 0, INF)),
        InvalidInputError,
        r"advantages\[0\] holds inf at position 0",
    ),
    "nan_old_logp": (
        lambda loop: loop.train_rest(old_logps=[[NAN, *loop.batch.old_logps[2][1:]], loop.batch.old_logps[3]]),
        InvalidInputError,
        r"old_logps\[0\] holds nan at position 0",
    ),
    "nan_reward": (
        lambda loop: GRPOAdvantage()(_replaced(loop.batch.rewards, 1, NAN), num_generations=NUM_SAMPLES),
        InvalidInputError,
        r"rewards\[1\] is nan: every entry must be finite",
    ),
    "inf_reward": (
        lambda loop: GRPOAdvantage()(_replaced(loop.batch.rewards, 2, -INF), num_generations=NUM_SAMPLES),
        InvalidInputError,
        r"rewards\[2\] is -inf: every entry must be finite",
    ),
    "reward_function_returning_nan": (
        lambda loop: FunctionReward(lambda completion, user_data: NAN)(loop.batch.inputs),
        InvalidInputError,
        r"FunctionReward: trajectories\[0\]: the reward must be finite, got nan",
    ),
    "num_samples_0": (
        lambda loop: loop.sampler.sample(loop.prompts, PARAMS, adapter_name=ADAPTER, num_samples=0),
        InvalidInputError,
        r"num_samples must be an int >= 1, got 0",
    ),
    "stop_string_longer_than_max_tokens": (
        lambda loop: loop.sampler.sample(
            loop.prompts, dataclasses.replace(PARAMS, stop=["#### so the final answer is"]), adapter_name=ADAPTER
        ),
        InvalidInputError,
        r"stop string '#### so the final answer is' is 6 tokens long but max_tokens=4: it could never be generated",
    ),
}


def test_the_reference_step_trains_on_the_resampled_batch(built_loop: Loop) -> None:
    """The comparisons below are meaningful: the rest of the step resamples the same batch and moves weights."""
    assert built_loop.reference.tokens == [sequence.tokens for sequence in built_loop.batch.response.sequences]
    assert any(advantage != 0 for advantage in built_loop.batch.advantages[NUM_SAMPLES:])
    assert any(not torch.equal(grad, built_loop.start["grads"][n]) for n, grad in built_loop.reference.grads.items())
    assert any(not torch.equal(w, built_loop.start["weights"][n]) for n, w in built_loop.reference.weights.items())


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_is_refused_naming_the_culprit_and_changes_nothing(loop: Loop, case: str) -> None:
    call, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=message):
        call(loop)
    loop.assert_untouched()
    loop.assert_continues_as_reference()


@pytest.mark.parametrize("micro_batch_size", [None, 1])
def test_rows_without_completion_tokens_train_on_the_others(loop: Loop, micro_batch_size: int | None) -> None:
    """Such a row (a prompt-only feature) adds nothing: loss and gradients are those of the batch without it."""
    output = loop.train_rest(
        inputs=[prompt_only(loop.prompts[0]), *loop.batch.inputs[NUM_SAMPLES:]],
        old_logps=[[], *loop.batch.old_logps[NUM_SAMPLES:]],
        advantages=[1.0, *loop.batch.advantages[NUM_SAMPLES:]],  # any advantage: no token carries it
        micro_batch_size=micro_batch_size,
    )
    assert output.loss == pytest.approx(loop.reference.loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(loop.trainable_grads(), loop.reference.grads)


def test_completions_that_are_only_a_stop_score_zero_and_train(loop: Loop) -> None:
    """A stop string matched by the first token leaves an empty completion: rewards score it 0.0, GRPO trains it."""
    first_token = loop.batch.response.sequences[0].tokens[0]
    stop = loop.sampler.decode([first_token])
    assert stop, "the first sampled token must have text to stop on"
    batch = loop.sample(dataclasses.replace(PARAMS, stop=[stop]))
    sequence = batch.response.sequences[0]
    assert (sequence.tokens, sequence.stop_reason, sequence.decoded) == ([first_token], "stop", "")
    assert sequence.new_input_feature["messages"][-1] == {"role": "assistant", "content": ""}
    assert sum(sequence.new_input_feature["loss_mask"]) == 1  # the stop token is trained
    for reward in (*REWARDS, MathAnswerReward()):
        assert reward([sequence.new_input_feature]) == [0.0], type(reward).__name__
    output = loop.model.forward_backward(inputs=batch.inputs, old_logps=batch.old_logps, advantages=batch.advantages)
    assert math.isfinite(output.loss)
    assert all(torch.isfinite(grad).all() for grad in loop.trainable_grads().values())
