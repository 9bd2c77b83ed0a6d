"""``CheckpointEngineManager``: keep a sampler on the trainer's current weights.

RL alternates sampling and training; before each round the sampler must hold
the policy being trained. With LoRA only the adapter changes, so only the
adapter moves (a few MB instead of the model); ``merge_and_sync=True`` instead
pushes every base weight with the adapter merged in, for samplers that serve
the policy as a plain model. In one process the tensors are handed over as
they are — the sampler copies them onto its own device — with no
serialisation. When the model or the sampler runs as Ray actors
(``twinkle.initialize(mode='ray')``), the weights are read in the model's
actor and go through the Ray object store straight to the sampler's actors;
only a reference passes through the driver. Between actors whose weights are on
GPUs (device groups that share no GPU) they are broadcast instead, in buckets over
NCCL (:mod:`.broadcast`), from the model's first actor to every sampler actor;
``transport="broadcast"`` does so between any actors (over gloo where a side is on
the CPU). Every actor of a model reads its weights either way: a sharded model
(FSDP2, tensor or pipeline parallelism) gathers them whole together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Literal, Protocol, runtime_checkable
from uuid import uuid4

import torch

from twinkle.checkpoint_engine import broadcast
from twinkle.checkpoint_engine.weights import lora_payload, merged_weights
from twinkle.errors import ConfigurationError
from twinkle.infra import device_group_of, exchange, relay
from twinkle.registry import register
from twinkle.utils import get_logger, pick_adapter

logger = get_logger(__name__)


class WeightReceiver(Protocol):
    """What a sampler offers to receive weights (``twinkle.sampler.TorchSampler`` implements all of it).

    ``add_adapter`` replaces an adapter of the same name with a copy of the
    given PEFT-format tensors (LoRA sync); ``load_base_weights`` copies named
    tensors (the base model's ``state_dict`` names), streamed one at a time,
    into the base model, after which ``reset_prefix_cache`` drops anything
    cached under the old weights (merged sync). A sampler needs only the
    methods of the mode it is synced with.
    """

    def add_adapter(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None: ...

    def load_base_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def reset_prefix_cache(self) -> None: ...


TRANSPORTS = ("auto", "object_store", "broadcast")
Payload = Any  # a LoRA sync's (config, tensors), or a merged sync's stream of (name, tensor)


@runtime_checkable
class WeightSource(Protocol):
    """A trainer that hands out its own weights (``twinkle.model.MultiLoraModel`` does).

    Trainers without these methods are read through PEFT (``model.model``, a ``PeftModel``).
    """

    def lora_payload(self, adapter_name: str) -> tuple[Any, Mapping[str, torch.Tensor]]: ...

    def merged_weights(self, adapter_name: str | None) -> Iterable[tuple[str, torch.Tensor]]: ...


@register("checkpoint_engine")
class CheckpointEngineManager:
    """Syncs ``model`` (a ``TransformersModel`` or a :class:`WeightSource` with ``.adapter_names``) into ``sampler``.

    ``adapter_name`` defaults to the model's only adapter; the sampler serves
    it under the same name, and a ``sample`` without ``adapter_name`` uses it
    while it is the sampler's only adapter (``use_base_model=True`` samples the
    bare base). A model without adapters (full-parameter training) can only
    be synced with ``merge_and_sync=True``. ``transport`` says how weights
    travel between actors (``"auto"``, ``"object_store"``, ``"broadcast"``: see
    the module docstring), ``bucket_mb`` the size of a broadcast's buckets.
    """

    def __init__(
        self,
        model: Any,
        sampler: WeightReceiver,
        adapter_name: str | None = None,
        transport: Literal["auto", "object_store", "broadcast"] = "auto",
        bucket_mb: float = 256,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ConfigurationError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if not bucket_mb > 0:
            raise ConfigurationError(f"bucket_mb must be positive, got {bucket_mb!r}")
        self.model = model
        self.sampler = sampler
        self.adapter_name = pick_adapter(model.adapter_names, adapter_name)
        self.transport = transport
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._key = uuid4().hex  # names this manager's meeting in the model's process
        self._transfers = 0
        self._nccl: bool | None = None  # whether a broadcast goes over NCCL (decided on the first sync)

    def sync_weights(self, merge_and_sync: bool = False) -> None:
        """Push the trainer's current weights into the sampler (see the module docstring)."""
        read, write = self._reader_writer(merge_and_sync)
        if self._broadcast(read, write, lora=not merge_and_sync):
            return
        if not relay(self.model, self.sampler, read, write):
            write(self.sampler, read(self.model))

    def _broadcast(self, read: Callable[[Any], Payload], write: Callable[[Any, Payload], None], lora: bool) -> bool:
        """Broadcast the payload from the model's first actor to the sampler's actors, if this sync does."""
        if self.transport == "object_store":
            return False
        if self._nccl is None:  # read once: under Ray each read asks an actor
            on_cuda = all(_device_type(side) == "cuda" for side in (self.model, self.sampler))
            self._nccl = on_cuda and _apart(self.model, self.sampler)
        if self.transport == "auto" and not self._nccl:
            return False
        self._transfers += 1
        transfer = str(self._transfers)
        backend = "nccl" if self._nccl else "gloo"
        prepare = partial(_open, key=self._key, backend=backend, bucket_bytes=self.bucket_bytes)
        send = partial(_send, read=read, lora=lora, transfer=transfer)
        receive = partial(_receive, write=write, lora=lora, transfer=transfer)
        if not exchange(self.model, self.sampler, prepare, send, receive, read):  # "auto" chose it for two actors
            raise ConfigurationError(
                "transport='broadcast' moves weights between actors: build the model and the sampler on Ray "
                "(twinkle.initialize(mode='ray'), remote_group=...)"
            )
        return True

    def _reader_writer(
        self, merge_and_sync: bool
    ) -> tuple[Callable[[Any], Any], Callable[[WeightReceiver, Any], None]]:
        """How this mode reads its payload (merged weights, or a LoRA config and tensors) and writes it."""
        if merge_and_sync:
            self._require("load_base_weights", "merged weights")
            return partial(_read_merged, adapter_name=self.adapter_name), _write_merged
        if self.adapter_name is None:
            raise ConfigurationError(
                "the model has no LoRA adapter to sync; use sync_weights(merge_and_sync=True) to push all weights"
            )
        self._require("add_adapter", "LoRA adapters")
        return partial(_read_lora, adapter_name=self.adapter_name), partial(_write_lora, adapter_name=self.adapter_name)

    def _require(self, method: str, what: str) -> None:
        if not callable(getattr(self.sampler, method, None)):
            raise ConfigurationError(f"{type(self.sampler).__name__} cannot receive {what}: it has no {method}()")


def _source(model: Any) -> WeightSource | None:
    return model if isinstance(model, WeightSource) else None


def _read_lora(model: Any, adapter_name: str) -> tuple[Any, Mapping[str, torch.Tensor]]:
    source = _source(model)
    return source.lora_payload(adapter_name) if source else lora_payload(model.model, adapter_name)


def _read_merged(model: Any, adapter_name: str | None) -> Iterable[tuple[str, torch.Tensor]]:
    source = _source(model)
    return source.merged_weights(adapter_name) if source else merged_weights(model.model, adapter_name)


def _write_lora(sampler: WeightReceiver, payload: tuple[Any, Mapping[str, torch.Tensor]], adapter_name: str) -> None:
    config, tensors = payload
    sampler.add_adapter(adapter_name, config, tensors)
    logger.debug("synced adapter %r: %d tensors", adapter_name, len(tensors))


def _write_merged(sampler: WeightReceiver, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    count = sampler.load_base_weights(weights)
    sampler.reset_prefix_cache()
    logger.debug("synced %d merged base weights", count)


def _device_type(component: Any) -> str:
    """``"cuda"`` or ``"cpu"``: where a model's or a sampler's weights live (its ``device``)."""
    return torch.device(getattr(component, "device", None) or "cpu").type


def _apart(model: Any, sampler: Any) -> bool:
    """Whether both are actors on device groups that share no device (NCCL cannot join two ranks on one GPU)."""
    groups = device_group_of(model), device_group_of(sampler)
    return groups[0] is not None and groups[1] is not None and not set(groups[0].ranks) & set(groups[1].ranks)


def _open(model: Any, host: str, receivers: int, key: str, backend: str, bucket_bytes: int) -> broadcast.Meeting:
    """Where the sampler's actors meet the model's first one (opened on the first sync, then kept)."""
    return broadcast.open_meeting(host, receivers, backend=backend, bucket_bytes=bucket_bytes, key=key)


def _send(model: Any, meeting: broadcast.Meeting, read: Callable[[Any], Payload], lora: bool, transfer: str) -> int:
    """The model's side: its payload as a header (a LoRA sync's config) and a stream of named tensors."""
    try:
        payload = read(model)
        header, tensors = (payload[0], payload[1].items()) if lora else (None, payload)
    except BaseException as error:
        broadcast.send_failure(meeting, transfer, error)
        raise
    return broadcast.send(meeting, transfer, tensors, header)


def _receive(
    sampler: Any,
    meeting: broadcast.Meeting,
    rank: int,
    write: Callable[[Any, Payload], None],
    lora: bool,
    transfer: str,
) -> None:
    """A sampler actor's side: the payload rebuilt from the header and the stream, then written as usual."""
    header, stream = broadcast.receive(meeting, transfer, rank)
    try:
        write(sampler, (header, dict(stream)) if lora else stream)
    finally:
        broadcast.drain(stream)  # whatever the sampler did not read: the sender waits for every receiver
