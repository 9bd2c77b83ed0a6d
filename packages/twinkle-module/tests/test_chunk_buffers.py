"""The chunked log-probs' CPU buffers: reused from pass to pass, never shared by two passes alive at once."""

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.module import chunked_token_logps
from twinkle.module.chunk_buffers import ChunkBuffers
from twinkle.module.logps import CPU_BUFFERS


def test_take_gives_the_smallest_fitting_buffer_of_the_dtype_and_free_ones_stay_under_the_bound():
    buffers = ChunkBuffers(max_free_bytes=1000)
    small, large = buffers.take(2, 10, torch.float32), buffers.take(4, 10, torch.float32)  # 80 and 160 bytes
    buffers.give(large)
    buffers.give(small)
    assert buffers.free_bytes == 240
    assert buffers.take(2, 10, torch.float64).data_ptr() not in (small.data_ptr(), large.data_ptr())
    reused = buffers.take(1, 15, torch.float32)  # 60 bytes: the 80-byte buffer fits best
    assert reused.shape == (1, 15) and reused.is_contiguous() and reused.data_ptr() == small.data_ptr()
    buffers.give(reused)
    buffers.give(buffers.take(30, 10, torch.float32))  # 1200 bytes: over the bound, dropped with the smallest
    assert buffers.free_bytes <= 1000


def _case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(12, 8, dtype=torch.float64, generator=generator).requires_grad_()
    labels = torch.randint(0, 40, (12,), generator=generator)
    labels[0] = IGNORE_INDEX
    return hidden, torch.randn(40, 8, dtype=torch.float64, generator=generator).requires_grad_(), labels


def _autograd(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logps = torch.log_softmax(hidden @ weight.T, dim=-1)
    valid = labels != IGNORE_INDEX
    return torch.where(valid, logps.gather(-1, torch.where(valid, labels, 0)[:, None])[:, 0], 0.0)


def test_passes_alive_at_once_hold_their_own_buffers_and_a_finished_pass_lends_its_buffer_to_the_next():
    CPU_BUFFERS.clear()
    cases = [_case(seed) for seed in range(3)]
    # Two passes' forwards before either backward (probabilities kept for the backward, 12 x 40 float64 each).
    first, second = (chunked_token_logps(*case).logps for case in cases[:2])
    assert CPU_BUFFERS.free_bytes == 0
    (first.sum() + 2 * second.sum()).backward()
    assert CPU_BUFFERS.free_bytes == 2 * 12 * 40 * 8, "both buffers are free once their backward ran"
    dropped = chunked_token_logps(*cases[2]).logps  # a graph that never runs its backward
    del dropped
    third = chunked_token_logps(*cases[2]).logps
    third.sum().backward()
    for (hidden, weight, labels), scale in zip(cases, (1, 2, 1), strict=True):
        expected = torch.autograd.grad(scale * _autograd(hidden, weight, labels).sum(), (hidden, weight))
        for got, want in zip((hidden.grad, weight.grad), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(third, _autograd(*cases[2]), atol=1e-12, rtol=0)


def test_a_forward_without_backward_leaves_its_buffer_free():
    CPU_BUFFERS.clear()
    hidden, weight, labels = _case(0)
    with torch.no_grad():
        logps = chunked_token_logps(hidden, weight, labels).logps
    assert CPU_BUFFERS.free_bytes == 12 * 40 * 8
    torch.testing.assert_close(logps, _autograd(hidden, weight, labels).detach(), atol=1e-12, rtol=0)
    chunked_token_logps(hidden.detach(), weight.detach(), labels)  # nothing requires a gradient
    assert CPU_BUFFERS.free_bytes == 12 * 40 * 8


def test_a_frozen_output_layer_frees_every_buffer_in_the_forward():
    """Training below the output layer keeps ``softmax @ W`` for the backward, no ``[chunk, V]`` buffer."""
    CPU_BUFFERS.clear()
    hidden, weight, labels = _case(0)
    weight = weight.detach()
    logps = chunked_token_logps(hidden, weight, labels, chunk_size=5).logps
    assert CPU_BUFFERS.free_bytes == 5 * 40 * 8, "each chunk's buffer is free for the next one before the backward"
    logps.sum().backward()
    torch.testing.assert_close(hidden.grad, torch.autograd.grad(_autograd(hidden, weight, labels).sum(), hidden)[0])


def test_cpu_chunks_whose_logits_are_not_kept_are_cache_sized(monkeypatch):
    """Without kept logits a CPU chunk is at most ``CPU_CHUNK_BYTES`` of them, whatever ``chunk_size`` says."""
    from twinkle.module import logps as logps_module

    monkeypatch.setattr(logps_module, "CPU_CHUNK_BYTES", 3 * 40 * 8)  # 3 positions of a 40-token float64 vocabulary
    CPU_BUFFERS.clear()
    hidden, weight, labels = _case(0)
    weight = weight.detach()
    logps = chunked_token_logps(hidden, weight, labels, chunk_size=4096).logps
    assert CPU_BUFFERS.free_bytes == 3 * 40 * 8
    torch.testing.assert_close(logps, _autograd(hidden, weight, labels), atol=1e-12, rtol=0)
    trained = chunked_token_logps(hidden, weight.requires_grad_(), labels, chunk_size=4096).logps
    assert CPU_BUFFERS.free_bytes == 3 * 40 * 8, "kept for the backward: one chunk as asked, not the cap"
    del trained
