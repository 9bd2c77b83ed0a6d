"""Bucketed broadcasts over gloo: a sender and receivers in threads of this process, as they would be in actors."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from twinkle.checkpoint_engine.broadcast import Meeting, drain, open_meeting, receive, send, send_failure


def _tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(7, 300, generator=generator)
    return [
        ("embed", torch.randn(50, 16, generator=generator)),
        ("norm", torch.randn(16, generator=generator).to(torch.bfloat16)),
        ("big", torch.randn(2000, generator=generator)),  # 8,000 bytes: more than a bucket, sent alone
        ("step", torch.tensor(3)),  # 0-dim int64
        ("mask", torch.rand(13, generator=generator) > 0.5),
        ("empty", torch.empty(0, 4)),
        ("strided", wide[:, ::3]),  # not contiguous
        ("half", torch.randn(3, 5, generator=generator).half()),
    ]


def _run(
    meeting: Meeting, transfer: str, tensors: Any, read: Callable[[Iterator[tuple[str, torch.Tensor]]], Any]
) -> tuple[Any, list[Any]]:
    """``send`` in one thread, ``read(stream)`` in one per receiver; the sender's and receivers' outcomes."""
    outcomes: dict[int, Any] = {}

    def receiver(rank: int) -> None:
        try:
            header, stream = receive(meeting, transfer, rank)
            try:
                outcomes[rank] = (header, read(stream))
            except Exception:
                drain(stream)
                raise
        except Exception as error:
            outcomes[rank] = error

    def sender() -> None:
        try:
            outcomes[0] = send(meeting, transfer, tensors, header={"config": "lora"})
        except Exception as error:
            outcomes[0] = error

    threads = [threading.Thread(target=sender)] + [
        threading.Thread(target=receiver, args=(rank,)) for rank in range(1, meeting.receivers + 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a side of the transfer is stuck"
    return outcomes[0], [outcomes[rank] for rank in range(1, meeting.receivers + 1)]


def _copied(stream: Iterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.clone()) for name, tensor in stream]  # as a receiver copies them into its model


def test_every_tensor_arrives_whole_in_order_at_every_receiver_and_the_group_is_reused():
    meeting = open_meeting("127.0.0.1", 2, bucket_bytes=4096, timeout_s=30)
    tensors = _tensors()
    for transfer in ("first", "second"):  # the second one reuses the group the first one made
        sent, received = _run(meeting, transfer, tensors, _copied)
        assert sent == len(tensors)
        for header, arrived in received:
            assert header == {"config": "lora"}
            assert [name for name, _ in arrived] == [name for name, _ in tensors]
            for (name, tensor), (_, copy) in zip(tensors, arrived, strict=True):
                assert copy.dtype == tensor.dtype and copy.shape == tensor.shape, name
                assert torch.equal(copy, tensor), name


def test_a_receiver_that_fails_while_reading_lets_the_others_and_the_sender_finish():
    meeting = open_meeting("127.0.0.1", 2, bucket_bytes=1024, timeout_s=30)

    failed: list[bool] = []

    def the_first_reader_fails(stream: Iterator[tuple[str, torch.Tensor]]) -> Any:
        if failed:
            return _copied(stream)
        failed.append(True)
        next(stream)
        raise ValueError("the model has no such weight")

    sent, received = _run(meeting, "t", _tensors(), the_first_reader_fails)
    assert sent == len(_tensors())
    assert sorted(type(outcome).__name__ for outcome in received) == ["ValueError", "tuple"]
    sent, received = _run(meeting, "u", _tensors(), _copied)  # and the group still works
    assert sent == len(_tensors()) and all(isinstance(outcome, tuple) for outcome in received)


def test_a_sender_that_fails_midway_stops_every_receiver_with_its_message():
    meeting = open_meeting("127.0.0.1", 1, bucket_bytes=1024, timeout_s=30)

    def breaks_after_two() -> Iterator[tuple[str, torch.Tensor]]:
        yield from _tensors()[:3]
        raise KeyError("lm_head.weight")

    sent, (received,) = _run(meeting, "t", breaks_after_two(), _copied)
    assert isinstance(sent, KeyError)
    assert isinstance(received, RuntimeError) and "the sender failed: KeyError: 'lm_head.weight'" in str(received)


def test_a_sender_that_fails_before_sending_stops_every_receiver_with_its_message():
    meeting = open_meeting("127.0.0.1", 2, timeout_s=30)
    errors: dict[int, BaseException] = {}

    def receiver(rank: int) -> None:
        try:
            receive(meeting, "t", rank)
        except RuntimeError as error:
            errors[rank] = error

    threads = [threading.Thread(target=receiver, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    send_failure(meeting, "t", ValueError("adapter 'x' uses DoRA"))
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(errors) == [1, 2]
    assert all("the sender failed: ValueError: adapter 'x' uses DoRA" in str(error) for error in errors.values())


def test_a_meeting_is_kept_under_its_key_and_bad_meetings_are_refused() -> None:
    first = open_meeting("127.0.0.1", 1, key="manager-1")
    assert open_meeting("127.0.0.1", 1, key="manager-1") is first
    assert open_meeting("127.0.0.1", 1, key="manager-2").port != first.port
    with pytest.raises(Exception, match="backend must be 'nccl' or 'gloo', got 'mpi'"):
        open_meeting("127.0.0.1", 1, backend="mpi")
    with pytest.raises(Exception, match="no meeting was opened on port 1"):
        send(Meeting("127.0.0.1", 1, receivers=1), "t", [])
