"""Which share of each global batch this process takes.

Under ``torchrun`` every process runs the same script and builds its own
DataLoader, so each one keeps only its data-parallel rank's slice: with 8
data-parallel ranks and a batch of 16, rank ``r`` gets rows ``[2r, 2r+2)``;
ranks that differ only in tensor/pipeline/context parallelism get the same
slice. In a single process, or on a driver that dispatches work to remote
workers (Ray), the loader yields the whole batch and the infrastructure splits
it along the model's mesh.
"""

from __future__ import annotations

from twinkle.errors import ConfigurationError
from twinkle.infra import DeviceMesh, get_runtime


def slice_rank(device_mesh: DeviceMesh | None, rank: int | None, remote_group: str) -> int | None:
    """The mesh rank whose slice this process takes, or ``None`` for whole batches.

    ``rank`` overrides the process's rank (tests, custom launchers); otherwise
    it comes from the torchrun runtime, translated to a rank within ``remote_group``.
    """
    if device_mesh is None:
        if rank is not None:
            raise ConfigurationError(f"DataLoader(rank={rank}) needs a device_mesh to know the slice of that rank")
        return None
    if rank is not None:
        device_mesh.coords(rank)  # validates the range
        return rank
    runtime = get_runtime()
    if runtime.mode != "local" or not runtime.is_torchrun:
        return None
    ranks = runtime.groups[remote_group].ranks
    if runtime.rank not in ranks:
        raise ConfigurationError(
            f"process rank {runtime.rank} builds a DataLoader on device group {remote_group!r}, "
            f"which holds ranks {ranks}"
        )
    local_rank = ranks.index(runtime.rank)
    device_mesh.coords(local_rank)
    return local_rank
