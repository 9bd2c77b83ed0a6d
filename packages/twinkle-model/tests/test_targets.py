"""Log-probs of arbitrary targets (Tinker's layout) equal those of the full logits, and train the right weights."""

import pytest
import torch
from peft import LoraConfig

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model import MultiLoraModel, TargetSequence, TransformersModel, target_logps
from twinkle.module import adapter_rows

VOCAB_SIZE = 151936  # the builtin tiny Qwen3
MAX_POSITIONS = 4096


def _sequences() -> list[TargetSequence]:
    """Different lengths (padding), shifted and arbitrary 1-D targets, and a top-3 2-D sequence."""
    generator = torch.Generator().manual_seed(0)

    def ids(*shape: int) -> torch.Tensor:
        return torch.randint(0, VOCAB_SIZE, shape, generator=generator)

    text = ids(12)
    return [
        TargetSequence(text[:-1], text[1:]),  # next-token targets
        TargetSequence(ids(5), ids(5)),  # arbitrary ids
        TargetSequence(ids(9), ids(9, 3)),  # top-K distillation
    ]


def _reference(module: torch.nn.Module, sequence: TargetSequence) -> torch.Tensor:
    """The sequence alone (no padding) through the model's full logits.

    In float64: a float32 ``log_softmax`` over the 152k vocabulary is itself off by ~4e-5 on CPU.
    """
    logps_TV = module(input_ids=sequence.tokens[None]).logits[0].double().log_softmax(-1)
    targets = sequence.targets
    picked = logps_TV.gather(-1, targets if targets.dim() == 2 else targets[:, None]).float()
    return picked if targets.dim() == 2 else picked[:, 0]


def _loss(logps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """A weighted sum, so every position and target gets its own gradient."""
    total = sum((t * torch.linspace(-1, 1, t.numel()).reshape(t.shape)).sum() for t in logps)
    return total, {"sequences": float(len(logps))}


# Gradients reach ~7 here; the fp32 reference's own gradients move by ~8e-5 with how log_softmax is computed.
GRAD_TOL = {"atol": 1e-4, "rtol": 1e-4}


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _reference_grads(params, module, sequences) -> list[torch.Tensor]:
    for param in params:
        param.grad = None
    _loss([_reference(module, s) for s in sequences])[0].backward()
    grads = _grads(params)
    for param in params:
        param.grad = None
    return grads


@pytest.fixture
def lora(new_lora_model):
    model = new_lora_model()
    model.logps_chunk_size = 4  # several chunks per call
    return model


@pytest.fixture
def multi():
    torch.manual_seed(0)
    model = MultiLoraModel(device="cpu", max_loras=2, max_rank=4, logps_chunk_size=4)
    for seed, name in enumerate(("a", "b")):
        model.add_adapter_to_model(name, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, tensor in model.lora_payload(name)[1].items():
                if "lora_B" in key:
                    tensor.normal_(0, 0.1, generator=generator)
    return model


def test_logps_equal_the_full_logits_of_each_sequence_alone(lora):
    sequences = _sequences()
    output = lora.forward_backward_targets(sequences, backward=False)
    assert output.loss is None
    with torch.no_grad():
        for ours, sequence in zip(output.logps, sequences, strict=True):
            assert ours.shape == sequence.targets.shape and ours.dtype == torch.float32
            torch.testing.assert_close(ours, _reference(lora.model, sequence), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 5, 4096])
def test_target_logps_function_has_autograd_and_any_chunk_size(lora, chunk_size):
    sequences = _sequences()
    logps = target_logps(lora.model, sequences, chunk_size=chunk_size)
    assert all(t.requires_grad for t in logps)
    with torch.no_grad():
        for ours, sequence in zip(logps, sequences, strict=True):
            torch.testing.assert_close(ours.detach(), _reference(lora.model, sequence), atol=1e-5, rtol=0)


def test_padding_does_not_change_values(lora):
    sequences = _sequences()
    with torch.no_grad():
        together = target_logps(lora.model, sequences, chunk_size=4)
        for index, sequence in enumerate(sequences):
            alone = target_logps(lora.model, [sequence], chunk_size=4)[0]
            torch.testing.assert_close(together[index], alone, atol=1e-5, rtol=0)


def test_no_logits_are_kept_for_backward(lora):
    """Top-K chunks are checkpointed: no ``[*, V]`` tensor is saved outside them."""
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps = target_logps(lora.model, _sequences()[2:], chunk_size=4)
    logps[0].sum().backward()
    assert shapes and not [shape for shape in shapes if shape[-1] == VOCAB_SIZE]


@pytest.mark.parametrize("which", [slice(0, 2), slice(0, 3)], ids=["1d-only", "mixed-1d-2d"])
def test_gradients_equal_the_reference_loss_gradients(lora, which):
    sequences = _sequences()[which]
    params = lora.train_state(None).params
    expected = _reference_grads(params, lora.model, sequences)
    output = lora.forward_backward_targets(sequences, _loss)
    assert output.metrics == {"sequences": float(len(sequences))}
    assert output.loss == pytest.approx(float(_loss(output.logps)[0]), abs=1e-4)
    assert lora.train_state(None).accumulated == 1
    for ours, reference in zip(_grads(params), expected, strict=True):
        torch.testing.assert_close(ours, reference, **GRAD_TOL)


def test_gradients_are_scaled_by_accumulation_steps(new_lora_model):
    model = new_lora_model(gradient_accumulation_steps=2)
    params = model.train_state(None).params
    expected = _reference_grads(params, model.model, _sequences())
    model.forward_backward_targets(_sequences(), _loss)
    for ours, reference in zip(_grads(params), expected, strict=True):
        torch.testing.assert_close(ours, reference / 2, **GRAD_TOL)


def test_full_model_gradients_equal_the_reference():
    torch.manual_seed(0)
    model = TransformersModel(device="cpu", logps_chunk_size=4)
    sequences = _sequences()
    params = model.train_state(None).params
    expected = _reference_grads(params, model.model, sequences)
    model.forward_backward_targets(sequences, _loss)
    for ours, reference in zip(_grads(params), expected, strict=True):
        torch.testing.assert_close(ours, reference, **GRAD_TOL)


def test_multi_lora_trains_only_the_named_adapter(multi):
    sequences = _sequences()
    params_a, params_b = multi.train_state("a").params, multi.train_state("b").params
    with adapter_rows(multi.model, ["a"] * 1):
        expected = _reference_grads(params_a, multi.model, sequences)
        with torch.no_grad():
            references = [_reference(multi.model, s) for s in sequences]
    output = multi.forward_backward_targets(sequences, _loss, adapter_name="a")
    for ours, reference in zip(output.logps, references, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    for ours, reference in zip(_grads(params_a), expected, strict=True):
        torch.testing.assert_close(ours, reference, **GRAD_TOL)
    assert all(p.grad is None for p in params_b)
    other = multi.forward_backward_targets(sequences, adapter_name="b", backward=False)
    assert not torch.allclose(other.logps[0], output.logps[0])  # the adapters really differ


def test_forward_only_reports_the_loss_and_leaves_no_gradients(lora):
    output = lora.forward_backward_targets(_sequences(), _loss, backward=False)
    assert output.loss == pytest.approx(float(_loss(output.logps)[0]), abs=1e-4)
    assert all(p.grad is None for p in lora.model.parameters())
    assert lora.model.training and lora.train_state(None).accumulated == 0
    assert lora.calculate_metric(is_training=False)["loss"] == pytest.approx(output.loss)


def _bad(index_1: TargetSequence) -> list[TargetSequence]:
    return [TargetSequence(torch.tensor([1, 2]), torch.tensor([2, 3])), index_1]


LONG = torch.zeros(MAX_POSITIONS + 1, dtype=torch.long)
BAD_INPUTS = {
    "empty tokens": _bad(TargetSequence(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))),
    "float tokens": _bad(TargetSequence(torch.tensor([1.0, 2.0]), torch.tensor([2, 3]))),
    "float targets": _bad(TargetSequence(torch.tensor([1, 2]), torch.tensor([2.0, 3.0]))),
    "list tokens": _bad(TargetSequence([1, 2], torch.tensor([2, 3]))),
    "length mismatch": _bad(TargetSequence(torch.tensor([1, 2, 3]), torch.tensor([2, 3]))),
    "3-d targets": _bad(TargetSequence(torch.tensor([1, 2]), torch.zeros(2, 1, 1, dtype=torch.long))),
    "token id too large": _bad(TargetSequence(torch.tensor([1, VOCAB_SIZE]), torch.tensor([2, 3]))),
    "negative target": _bad(TargetSequence(torch.tensor([1, 2]), torch.tensor([2, -1]))),
    "top-k id too large": _bad(TargetSequence(torch.tensor([1, 2]), torch.tensor([[2, 3], [4, VOCAB_SIZE]]))),
    "too long": _bad(TargetSequence(LONG, LONG)),
    "k is 0": _bad(TargetSequence(torch.tensor([1, 2]), torch.zeros(2, 0, dtype=torch.long))),
}


@pytest.fixture(scope="module")
def accumulated(new_lora_model):
    """Gradients already accumulated, so 'untouched' is not trivially 'None'."""
    model = new_lora_model()
    model.forward_backward_targets(_sequences(), _loss)
    return model


def _snapshot(model) -> dict[str, dict[str, torch.Tensor]]:
    named = list(model.model.named_parameters())
    return {
        "weights": {n: p.detach().clone() for n, p in named},
        "grads": {n: p.grad.clone() for n, p in named if p.grad is not None},
    }


def _assert_untouched(model, before) -> None:
    after = _snapshot(model)
    assert after["grads"].keys() == before["grads"].keys() and after["grads"]
    for kind in ("weights", "grads"):
        for name, tensor in before[kind].items():
            assert torch.equal(after[kind][name], tensor), (kind, name)
    assert model.train_state(None).accumulated == 1


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_sequences_are_rejected_with_their_index(accumulated, case):
    before = _snapshot(accumulated)
    with pytest.raises(InvalidInputError, match=r"sequences\[1\]"):
        accumulated.forward_backward_targets(BAD_INPUTS[case], _loss)
    _assert_untouched(accumulated, before)


def test_empty_sequences_and_missing_loss_fn_are_rejected(accumulated):
    before = _snapshot(accumulated)
    with pytest.raises(InvalidInputError, match="non-empty"):
        accumulated.forward_backward_targets([], _loss)
    with pytest.raises(InvalidInputError, match="loss_fn"):
        accumulated.forward_backward_targets(_sequences())
    with pytest.raises(InvalidInputError, match="non-empty"):
        target_logps(accumulated.model, [])
    _assert_untouched(accumulated, before)


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda logps: (logps[0].sum() * float("nan"), {}),
        lambda logps: (logps[0].sum() + float("inf"), {}),
        lambda logps: (logps[0], {}),  # not a scalar
        lambda logps: logps[0].sum(),  # no metrics
        lambda logps: (logps[0].sum().detach(), {}),  # no gradient
    ],
    ids=["nan", "inf", "not-scalar", "no-metrics", "detached"],
)
def test_a_bad_loss_leaves_gradients_as_they_were(accumulated, loss_fn):
    before = _snapshot(accumulated)
    with pytest.raises(InvalidInputError):
        accumulated.forward_backward_targets(_sequences(), loss_fn)
    _assert_untouched(accumulated, before)


def test_an_exception_in_the_loss_leaves_gradients_as_they_were(accumulated):
    def half_applied(logps):
        logps[0].sum().backward(retain_graph=True)  # gradients change, then the loss fails
        raise RuntimeError("boom")

    before = _snapshot(accumulated)
    with pytest.raises(RuntimeError, match="boom"):
        accumulated.forward_backward_targets(_sequences(), half_applied)
    _assert_untouched(accumulated, before)


@pytest.mark.parametrize("backend", ["transformers", "multi"])
def test_update_optimizer_changes_hyperparameters_in_place(backend, new_lora_model, multi):
    model = new_lora_model() if backend == "transformers" else multi
    name = None if backend == "transformers" else "a"
    with pytest.raises(ConfigurationError, match="set_optimizer"):
        model.update_optimizer(adapter_name=name, lr=1e-3)
    model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
    model.forward_backward_targets(_sequences()[:1], _loss, adapter_name=name)
    model.clip_grad_and_step(adapter_name=name)
    optimizer = model.train_state(name).optimizer
    moments = {id(p): s["exp_avg"].clone() for p, s in optimizer.state.items()}
    assert moments
    model.update_optimizer(adapter_name=name, lr=1e-3, betas=(0.8, 0.95), weight_decay=0.0)
    assert model.train_state(name).optimizer is optimizer
    for group in optimizer.param_groups:
        assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.8, 0.95), 0.0)
    for param, state in optimizer.state.items():
        assert torch.equal(state["exp_avg"], moments[id(param)])
    with pytest.raises(InvalidInputError, match="momentum"):
        model.update_optimizer(adapter_name=name, lr=5e-4, momentum=0.9)
    with pytest.raises(InvalidInputError, match="lr"):
        model.update_optimizer(adapter_name=name, lr=float("nan"))
    assert all(group["lr"] == 1e-3 for group in optimizer.param_groups)  # a rejected call changes nothing
