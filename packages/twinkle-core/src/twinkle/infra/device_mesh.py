"""Where work runs: :class:`DeviceGroup` (a named set of ranks) and :class:`DeviceMesh`.

A mesh lays ``world_size`` ranks out on named parallel dimensions, outermost
first: ``pp, dp, fsdp, cp, tp`` (``tp`` varies fastest, so tensor-parallel
peers are neighbours, as in Megatron). Data parallelism spans ``dp × fsdp``:
those are the ranks that see different samples. Expert parallelism (``ep``)
is laid over the data-parallel ranks and must divide them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from twinkle.errors import ConfigurationError, InvalidInputError

MESH_DIMS: tuple[str, ...] = ("pp", "dp", "fsdp", "cp", "tp")
DATA_DIMS: tuple[str, ...] = ("dp", "fsdp")
_DEVICE_ALIASES = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu", "npu": "npu", "mps": "mps"}


def normalize_device_type(device_type: str) -> str:
    """Map user spellings (``'GPU'``, ``'cuda'``, ``'CPU'``) to torch device types."""
    key = str(device_type).lower()
    if key not in _DEVICE_ALIASES:
        raise ConfigurationError(f"unknown device_type {device_type!r}; use one of {sorted(set(_DEVICE_ALIASES))}")
    return _DEVICE_ALIASES[key]


@dataclass(init=False)  # the constructor takes a count for ``ranks``; the field is always the list
class DeviceGroup:
    """A named group of ranks (devices) that components can be placed on.

    ``ranks`` is a list of global ranks or a count (``8`` means ``0..7``).
    """

    name: str
    ranks: list[int]
    device_type: str = "cpu"
    gpus_per_worker: int = 1

    def __init__(self, name: str, ranks: list[int] | int, device_type: str = "cpu", gpus_per_worker: int = 1) -> None:
        if not name or not isinstance(name, str):
            raise ConfigurationError("DeviceGroup.name must be a non-empty string")
        if isinstance(ranks, int):
            if ranks < 1:
                raise ConfigurationError(f"DeviceGroup {name!r}: ranks count must be >= 1, got {ranks}")
            ranks = list(range(ranks))
        self.name = name
        self.ranks = [int(r) for r in ranks]
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ConfigurationError(f"DeviceGroup {name!r}: ranks must be distinct non-negative ints")
        self.device_type = normalize_device_type(device_type)
        if gpus_per_worker < 1:
            raise ConfigurationError(f"DeviceGroup {name!r}: gpus_per_worker must be >= 1")
        self.gpus_per_worker = gpus_per_worker

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass
class DeviceMesh:
    """Sizes of each parallel dimension plus helpers to map ranks to coordinates.

    Build it with :meth:`from_sizes`; ranks are mesh-local (``0..world_size-1``).
    """

    sizes: dict[str, int]
    ep_size: int = 1
    ulysses_size: int = 1
    device_type: str = "cpu"
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unknown = set(self.sizes) - set(MESH_DIMS)
        if unknown:
            raise ConfigurationError(f"unknown mesh dimension(s) {sorted(unknown)}; known: {MESH_DIMS}")
        self.sizes = {dim: int(self.sizes.get(dim, 1)) for dim in MESH_DIMS}
        for dim, size in self.sizes.items():
            if size < 1:
                raise ConfigurationError(f"{dim}_size must be >= 1, got {size}")
        for name, size in (("ep_size", self.ep_size), ("ulysses_size", self.ulysses_size)):
            if size < 1 or self.dp_fsdp_size % size:
                raise ConfigurationError(
                    f"{name}={size} must divide the data-parallel size dp*fsdp={self.dp_fsdp_size}"
                )
        self.device_type = normalize_device_type(self.device_type)
        stride, self._strides = 1, {}
        for dim in reversed(MESH_DIMS):
            self._strides[dim] = stride
            stride *= self.sizes[dim]

    @classmethod
    def from_sizes(
        cls,
        *,
        world_size: int | None = None,
        dp_size: int | None = None,
        fsdp_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        cp_size: int = 1,
        ep_size: int = 1,
        ulysses_size: int = 1,
        device_type: str = "cpu",
    ) -> DeviceMesh:
        """Build a mesh; ``dp_size`` is inferred from ``world_size`` when omitted.

        ``from_sizes(fsdp_size=4, dp_size=2)`` is an 8-rank mesh;
        ``from_sizes(world_size=8, fsdp_size=4)`` infers ``dp_size=2``;
        ``from_sizes(fsdp_size=2, ulysses_size=2)`` is two ranks that shard the model and split each sequence.
        """
        others = fsdp_size * tp_size * pp_size * cp_size
        if dp_size is None:
            if world_size is None:
                dp_size = 1
            elif world_size % others:
                raise ConfigurationError(
                    f"world_size={world_size} is not divisible by fsdp*tp*pp*cp={others}; cannot infer dp_size"
                )
            else:
                dp_size = world_size // others
        mesh = cls(
            sizes={"pp": pp_size, "dp": dp_size, "fsdp": fsdp_size, "cp": cp_size, "tp": tp_size},
            ep_size=ep_size,
            ulysses_size=ulysses_size,
            device_type=device_type,
        )
        if world_size is not None and world_size != mesh.world_size:
            raise ConfigurationError(
                f"world_size={world_size} does not equal the product of the mesh sizes "
                f"({' * '.join(f'{d}={s}' for d, s in mesh.sizes.items())} = {mesh.world_size})"
            )
        return mesh

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def dp_fsdp_size(self) -> int:
        """Number of data-parallel ranks (``dp × fsdp``): the DDP/FSDP group, over which gradients are averaged."""
        return self.sizes["dp"] * self.sizes["fsdp"]

    @property
    def data_world_size(self) -> int:
        """Number of ranks that receive different data (``dp × fsdp / ulysses``)."""
        return self.dp_fsdp_size // self.ulysses_size

    def size(self, dim: str) -> int:
        if dim == "ep":
            return self.ep_size
        if dim == "ulysses":
            return self.ulysses_size
        if dim not in self.sizes:
            raise InvalidInputError(f"unknown mesh dimension {dim!r}; known: {(*MESH_DIMS, 'ep', 'ulysses')}")
        return self.sizes[dim]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise InvalidInputError(f"rank {rank} is outside this mesh of world_size {self.world_size}")

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along every dimension."""
        self._check_rank(rank)
        return {dim: (rank // self._strides[dim]) % self.sizes[dim] for dim in MESH_DIMS}

    def rank_of(self, **coords: int) -> int:
        """Inverse of :meth:`coords`; omitted dimensions default to 0."""
        rank = 0
        for dim in MESH_DIMS:
            value = coords.pop(dim, 0)
            if not 0 <= value < self.sizes[dim]:
                raise InvalidInputError(f"{dim}={value} is outside [0, {self.sizes[dim]})")
            rank += value * self._strides[dim]
        if coords:
            raise InvalidInputError(f"unknown mesh dimension(s) {sorted(coords)}")
        return rank

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks that differ from ``rank`` only along ``dim`` (its communication group)."""
        base = self.coords(rank)
        return [self.rank_of(**{**base, dim: i}) for i in range(self.size(dim))]

    def _dp_fsdp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp"] * self.sizes["fsdp"] + c["fsdp"]

    def data_rank(self, rank: int) -> int:
        """Which of the ``data_world_size`` different shares of samples ``rank`` sees (``0..data_world_size-1``)."""
        return self._dp_fsdp_rank(rank) // self.ulysses_size

    def ulysses_rank(self, rank: int) -> int:
        """Which part of its samples' tokens ``rank`` computes in its Ulysses group (``0..ulysses_size-1``)."""
        return self._dp_fsdp_rank(rank) % self.ulysses_size

    def ulysses_groups(self) -> list[list[int]]:
        """Every Ulysses group's ranks, each in ``ulysses_rank`` order: the ranks that share samples."""
        return self._data_parallel_blocks(self.ulysses_size)

    def expert_rank(self, rank: int) -> int:
        """Which ``1/ep_size`` of every MoE layer's experts ``rank`` holds (``0..ep_size-1``)."""
        return self._dp_fsdp_rank(rank) % self.ep_size

    def expert_groups(self) -> list[list[int]]:
        """Every expert-parallel group's ranks, each in ``expert_rank`` order: together they hold every expert."""
        return self._data_parallel_blocks(self.ep_size)

    def _data_parallel_blocks(self, size: int) -> list[list[int]]:
        """The data-parallel ranks in blocks of ``size`` consecutive ones (for each tp/cp/pp coordinate)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault((c["pp"], c["cp"], c["tp"], self._dp_fsdp_rank(rank) // size), []).append(rank)
        return list(groups.values())

    def get_slice(self, total: int, rank: int) -> slice:
        """The contiguous share of ``total`` samples that ``rank`` processes.

        Shares differ by at most one sample; earlier data ranks take the remainder.
        Ranks in the same tp/cp/pp or Ulysses group get the same slice.
        """
        if total < 0:
            raise InvalidInputError(f"total must be >= 0, got {total}")
        index, parts = self.data_rank(rank), self.data_world_size
        base, extra = divmod(total, parts)
        start = index * base + min(index, extra)
        return slice(start, start + base + (1 if index < extra else 0))

    def to_dict(self) -> dict[str, Any]:
        return {
            **{f"{d}_size": s for d, s in self.sizes.items()},
            "ep_size": self.ep_size,
            "ulysses_size": self.ulysses_size,
            "device_type": self.device_type,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceMesh:
        return cls.from_sizes(**data)
