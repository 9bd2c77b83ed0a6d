import pytest
import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.module import LowRankTerm, chunked_token_logps, token_logps_from_logits


def _reference(hidden, weight, labels):
    logps = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    valid = labels != IGNORE_INDEX
    picked = logps.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, 0.0)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
@pytest.mark.parametrize("max_saved_bytes", [0, 1 << 20])
@pytest.mark.parametrize("trained_output", [True, False], ids=["trained-output", "frozen-output"])
def test_chunked_logps_match_full_logits_values_and_gradients(chunk_size, max_saved_bytes, trained_output):
    """Kept or recomputed probabilities (a trained output layer), or their product with it (a frozen one)."""
    torch.manual_seed(0)
    hidden = torch.randn(14, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=trained_output)
    labels = torch.randint(0, 50, (14,))
    labels[:2] = IGNORE_INDEX
    upstream = torch.randn(14, dtype=torch.float64)
    trained = (hidden, weight) if trained_output else (hidden,)

    ours, correct = chunked_token_logps(hidden, weight, labels, chunk_size, max_saved_bytes)
    grads = torch.autograd.grad((ours * upstream).sum(), trained)
    ref = _reference(hidden, weight, labels).double()
    ref_grads = torch.autograd.grad((ref * upstream).sum(), trained)

    torch.testing.assert_close(ours.double(), ref, atol=1e-6, rtol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (ours[:2] == 0).all()
    assert torch.equal(correct, (hidden @ weight.T).argmax(-1) == labels)


# Scattered rows (two adapters' rows interleaved), each adapter's rows in one run (as a shared pass orders
# them), and one adapter on every row (positions None).
LAYOUTS = {
    "scattered": [[0, 1, 2, 7, 8, 13], [4, 5, 6, 9]],
    "runs": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13]],
    "all": [None],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("max_saved_bytes", [0, 1 << 20])
@pytest.mark.parametrize("trained_B", [True, False], ids=["trained-B", "frozen-B"])
def test_low_rank_terms_on_some_positions_match_autograd(layout, chunk_size, max_saved_bytes, trained_B):
    """LoRA updates of the output layer, each on its own positions (rows of its adapter), in the chunks; with
    ``B`` frozen only ``u`` (through ``A``) and the hidden states are trained, from the softmax's products."""
    torch.manual_seed(0)
    hidden = torch.randn(14, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)  # frozen, as a shared base's output layer is
    labels = torch.randint(0, 50, (14,))
    labels[3] = IGNORE_INDEX
    positions = [None if rows is None else torch.tensor(rows) for rows in LAYOUTS[layout]]
    ranks = (2, 3)[: len(positions)]
    A = [torch.randn(rank, 16, dtype=torch.float64, requires_grad=True) for rank in ranks]
    B = [torch.randn(50, rank, dtype=torch.float64, requires_grad=trained_B) for rank in ranks]
    upstream = torch.randn(14, dtype=torch.float64)
    trained = (hidden, *A, *B) if trained_B else (hidden, *A)

    every = torch.arange(14)
    rows = [every if p is None else p for p in positions]
    terms = [LowRankTerm(p, hidden[r] @ a.T * 0.5, b) for p, r, a, b in zip(positions, rows, A, B, strict=True)]
    ours, correct = chunked_token_logps(hidden, weight, labels, chunk_size, max_saved_bytes, low_rank=terms)
    grads = torch.autograd.grad((ours * upstream).sum(), trained)
    logits = hidden @ weight.T
    for r, a, b in zip(rows, A, B, strict=True):
        logits = logits.index_add(0, r, (hidden[r] @ a.T * 0.5) @ b.T)
    valid = labels != IGNORE_INDEX
    ref = torch.where(valid, torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), trained)

    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-12)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.equal(correct, logits.argmax(-1) == labels)


@pytest.mark.parametrize("chunk_size", [1, 4])
def test_correct_is_argmax_equals_label_with_ties_going_to_the_first_maximum(chunk_size):
    """A row is correct when the label is the greedy token: the first of tied maxima, as ``argmax`` picks."""
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # vocab rows 0 and 2 always tie
    labels = torch.tensor([0, 1, 2, 0])  # tied and first; a unique maximum; tied but not first; not a maximum
    correct = chunked_token_logps(hidden, weight, labels, chunk_size).correct
    assert correct.tolist() == [True, True, False, False]
    assert torch.equal(correct, (hidden @ weight.T).argmax(-1) == labels)


def test_logps_from_logits_ignores_masked_labels():
    logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]])
    out = token_logps_from_logits(logits, torch.tensor([IGNORE_INDEX, 1]))
    assert out[0] == 0 and out[1] == pytest.approx(3 - torch.logsumexp(torch.tensor([1.0, 3.0]), 0).item())


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logps(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long), 0)
