import pytest
import torch
import torch.nn.functional as F

from twinkle.data_format import IGNORE_INDEX, ModelOutput
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.loss import CrossEntropyLoss
from twinkle.registry import build


def _batch(seed=0, batch=3, length=6, vocab=11):
    """Random logits and unshifted labels; logps[t] = log p(labels[t] | < t) as the model produces them."""
    g = torch.Generator().manual_seed(seed)
    logits_BTV = torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)
    labels_BT = torch.randint(0, vocab, (batch, length), generator=g)
    labels_BT[:, 0] = IGNORE_INDEX  # the first token is never predicted
    labels_BT[0, 1:3] = IGNORE_INDEX
    logps_BT = torch.zeros(batch, length, dtype=torch.float64)
    logprobs = torch.log_softmax(logits_BTV[:, :-1], -1)
    valid = labels_BT[:, 1:] != IGNORE_INDEX
    picked = logprobs.gather(-1, labels_BT[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logps_BT[:, 1:] = torch.where(valid, picked, 0.0)
    inputs = {"labels": labels_BT, "loss_mask": (labels_BT != IGNORE_INDEX).long()}
    return logits_BTV, labels_BT, inputs, ModelOutput(logps=logps_BT)


def test_token_mean_and_sum_equal_torch_cross_entropy():
    logits, labels, inputs, outputs = _batch()
    shifted_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    shifted_labels = labels[:, 1:].reshape(-1)
    mean = F.cross_entropy(shifted_logits, shifted_labels, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(shifted_logits, shifted_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    result = CrossEntropyLoss()(inputs, outputs)
    torch.testing.assert_close(result.loss, mean)
    torch.testing.assert_close(CrossEntropyLoss("token_sum")(inputs, outputs).loss, total)
    assert result.num_tokens == int((shifted_labels != IGNORE_INDEX).sum())


def test_sequence_mean_weighs_each_sequence_equally():
    logits, labels, inputs, outputs = _batch()
    per_seq = [
        F.cross_entropy(logits[b, :-1], labels[b, 1:], ignore_index=IGNORE_INDEX) for b in range(labels.shape[0])
    ]
    expected = torch.stack(per_seq).mean()
    torch.testing.assert_close(CrossEntropyLoss("sequence_mean")(inputs, outputs).loss, expected)


def test_float_weights_scale_tokens():
    logits, labels, inputs, outputs = _batch()
    weights = torch.rand(labels.shape, dtype=torch.float64) * inputs["loss_mask"]
    per_token = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].clamp(min=0).reshape(-1), reduction="none"
    ).view(labels.shape[0], -1)
    expected = (per_token * weights[:, 1:]).sum() / weights.sum()
    got = CrossEntropyLoss()({**inputs, "loss_weights": weights}, outputs).loss
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("reduction", ["token_mean", "token_sum", "sequence_mean"])
def test_packed_row_equals_padded_batch(reduction):
    _, labels, inputs, outputs = _batch()
    lengths = [6, 6, 6]
    packed_inputs = {
        "labels": labels.reshape(1, -1),
        "loss_mask": inputs["loss_mask"].reshape(1, -1),
        "seq_lens": lengths,
    }
    packed = CrossEntropyLoss(reduction)(packed_inputs, ModelOutput(logps=outputs.logps.reshape(1, -1))).loss
    torch.testing.assert_close(packed, CrossEntropyLoss(reduction)(inputs, outputs).loss)


@pytest.mark.parametrize("reduction", ["token_mean", "token_sum", "sequence_mean"])
def test_micro_batches_with_global_normalizer_sum_to_full_batch(reduction):
    _, _, inputs, outputs = _batch(batch=4)
    loss = CrossEntropyLoss(reduction)
    normalizer = loss.normalizer(inputs)
    parts = [
        loss({k: v[i : i + 2] for k, v in inputs.items()}, ModelOutput(logps=outputs.logps[i : i + 2]), normalizer).loss
        for i in (0, 2)
    ]
    torch.testing.assert_close(sum(parts), loss(inputs, outputs).loss)


def test_errors():
    _, labels, inputs, outputs = _batch()
    nothing = {"labels": torch.full_like(labels, IGNORE_INDEX), "loss_mask": torch.zeros_like(labels)}
    with pytest.raises(InvalidInputError, match="no supervised token"):
        CrossEntropyLoss()(nothing, outputs)
    with pytest.raises(InvalidInputError, match="needs per-token logps"):
        CrossEntropyLoss()(inputs, ModelOutput())
    with pytest.raises(InvalidInputError, match=r"takes no extra inputs, got \['advantages'\]"):
        CrossEntropyLoss()(inputs, outputs, advantages=[1.0])
    with pytest.raises(ConfigurationError, match="unknown reduction 'avg'"):
        CrossEntropyLoss("avg")


def test_resolves_by_name_through_entry_points():
    assert isinstance(build("loss", "CrossEntropyLoss"), CrossEntropyLoss)
    assert build("loss", "cross_entropy", reduction="token_sum").reduction.reduction == "token_sum"
