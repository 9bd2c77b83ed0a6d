"""Named tensors from one process to several over ``torch.distributed`` broadcasts, in buckets.

The sender (rank 0) packs the tensors, in order, into flat byte buckets of about ``bucket_bytes`` (a
larger tensor gets a bucket of its own) and broadcasts them; every receiver gets each bucket whole and
yields its tensors as views of it, one bucket after the other, so a receiver that copies them away as they
come (``load_base_weights``) never holds more than a bucket beyond its model. While one bucket is on the
wire the next is packed. What each bucket holds (names, dtypes, shapes, offsets) goes through the
rendezvous store, as does a sender's failure, so receivers stop with its message instead of waiting.

Between CUDA devices the group is NCCL's, otherwise gloo's (CPU buffers). Sender and receivers meet at a
:class:`Meeting` that the sender's process opens (:func:`open_meeting`: a listening socket on its address,
which the store takes over); the group then stays up for later transfers under the same meeting.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from twinkle.errors import ConfigurationError

ALIGN = 64  # bytes: every tensor starts on a boundary any dtype can be viewed at
_listening: dict[int, socket.socket] = {}  # port -> the sender's socket (its store listens on it)
_opened: dict[str, Meeting] = {}  # key -> the meeting this (sending) process opened under it
_groups: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # (host, port, rank) -> this rank's (store, group)


@dataclass(frozen=True)
class Meeting:
    """Where a sender and its ``receivers`` meet, and how they transfer."""

    host: str
    port: int
    receivers: int
    backend: str = "gloo"  # "nccl" where every side has CUDA
    bucket_bytes: int = 256 * 2**20
    timeout_s: float = 600.0


def open_meeting(
    host: str,
    receivers: int,
    *,
    backend: str = "gloo",
    bucket_bytes: int = 256 * 2**20,
    timeout_s: float = 600.0,
    key: str | None = None,
) -> Meeting:
    """A meeting for ``receivers`` at a free port of ``host`` (this process's address, as the receivers reach it),
    listening from now on. With ``key``, the meeting this process opened under that key before, if any."""
    if key is not None and key in _opened:
        return _opened[key]
    if backend not in ("nccl", "gloo"):
        raise ConfigurationError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    port = listener.getsockname()[1]
    _listening[port] = listener
    meeting = Meeting(host, port, receivers, backend, bucket_bytes, timeout_s)
    if key is not None:
        _opened[key] = meeting
    return meeting


def send(meeting: Meeting, transfer: str, tensors: Iterable[tuple[str, torch.Tensor]], header: Any = None) -> int:
    """Broadcast ``tensors`` to every receiver of ``meeting`` as transfer ``transfer`` (unique per meeting);
    ``header`` (any picklable value) goes along. Returns how many tensors were sent."""
    store, group = _group(meeting, 0)
    device = torch.device("cuda", torch.cuda.current_device()) if meeting.backend == "nccl" else torch.device("cpu")
    store.set(f"{transfer}/header", pickle.dumps((True, header)))
    count, index, in_flight = 0, 0, None
    try:
        for layout, bucket in _buckets(tensors, meeting.bucket_bytes, device):
            store.set(f"{transfer}/{index}", pickle.dumps(layout))
            work = group.broadcast([bucket], _root())
            if in_flight is not None:
                in_flight.wait()  # at most two buckets alive: the one on the wire and the one just packed
            in_flight, index, count = work, index + 1, count + len(layout)
        if in_flight is not None:
            in_flight.wait()
    except BaseException as error:
        store.set(f"{transfer}/{index}", pickle.dumps(_failure(error)))
        raise
    store.set(f"{transfer}/{index}", pickle.dumps(None))
    return count


def send_failure(meeting: Meeting, transfer: str, error: BaseException) -> None:
    """Tell the receivers of transfer ``transfer`` that the sender failed before sending anything."""
    store, _ = _group(meeting, 0)
    store.set(f"{transfer}/header", pickle.dumps((False, _failure(error))))


def receive(meeting: Meeting, transfer: str, rank: int) -> tuple[Any, Iterator[tuple[str, torch.Tensor]]]:
    """Receiver ``rank`` (1 .. receivers) of transfer ``transfer``: its header and a stream of the tensors.

    The stream must be read to its end, even after a failure in its reader (see :func:`drain`): the
    sender's broadcasts wait for every receiver.
    """
    store, group = _group(meeting, rank)
    sending, header = pickle.loads(store.get(f"{transfer}/header"))
    if not sending:
        raise RuntimeError(header)
    return header, _received(store, group, meeting, transfer)


def drain(stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Receive what is left of ``stream`` (after its reader failed), so that the sender can finish."""
    for _ in stream:
        pass


def _received(store: Any, group: Any, meeting: Meeting, transfer: str) -> Iterator[tuple[str, torch.Tensor]]:
    device = torch.device("cuda", torch.cuda.current_device()) if meeting.backend == "nccl" else torch.device("cpu")
    index = 0
    while True:
        layout = pickle.loads(store.get(f"{transfer}/{index}"))
        if layout is None:
            return
        if isinstance(layout, str):
            raise RuntimeError(layout)
        size = layout[-1][3] + layout[-1][4]
        bucket = torch.empty(size, dtype=torch.uint8, device=device)
        group.broadcast([bucket], _root()).wait()
        for name, dtype, shape, offset, nbytes in layout:
            yield name, bucket[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
        index += 1


def _buckets(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device
) -> Iterator[tuple[list[tuple[str, str, list[int], int, int]], torch.Tensor]]:
    """``(layout, bucket)`` pairs: each layout entry is ``(name, dtype, shape, offset, nbytes)``."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        start = -(-size // ALIGN) * ALIGN
        if pending and start + tensor.nbytes > bucket_bytes:
            yield _packed(pending, device)
            pending, start = [], 0
        pending.append((name, tensor))
        size = start + tensor.nbytes
    if pending:
        yield _packed(pending, device)


def _packed(
    tensors: list[tuple[str, torch.Tensor]], device: torch.device
) -> tuple[list[tuple[str, str, list[int], int, int]], torch.Tensor]:
    layout, offset = [], 0
    for name, tensor in tensors:
        offset = -(-offset // ALIGN) * ALIGN
        layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, tensor.nbytes))
        offset += tensor.nbytes
    bucket = torch.empty(offset, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for (_, tensor), (_, _, _, start, nbytes) in zip(tensors, layout, strict=True):
            if nbytes:
                bucket[start : start + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return layout, bucket


def _failure(error: BaseException) -> str:
    return f"the sender failed: {type(error).__name__}: {error}"


def _root() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return options


def _group(meeting: Meeting, rank: int) -> tuple[Any, Any]:
    """This process's store and process group for ``meeting`` (made on first use, then kept)."""
    key = (meeting.host, meeting.port, rank)
    if key in _groups:
        return _groups[key]
    size, timeout = 1 + meeting.receivers, timedelta(seconds=meeting.timeout_s)
    group: Any
    if rank == 0:
        listener = _listening.get(meeting.port)
        if listener is None:
            raise ConfigurationError(f"no meeting was opened on port {meeting.port} in this process (open_meeting)")
        store = dist.TCPStore(  # type: ignore[attr-defined]
            meeting.host, meeting.port, size, True, timeout, wait_for_workers=False, master_listen_fd=listener.fileno()
        )
    else:
        store = dist.TCPStore(meeting.host, meeting.port, size, False, timeout)  # type: ignore[attr-defined]
    if meeting.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(meeting.host, meeting.port))]
        gloo._timeout = timeout
        group = dist.ProcessGroupGloo(store, rank, size, gloo)
    _groups[key] = (store, group)
    return store, group


def _local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (the sender's own for the sender; 127.0.0.1 locally)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # a UDP "connect" sends nothing; it only picks the route
        address: str = probe.getsockname()[0]
        return address
