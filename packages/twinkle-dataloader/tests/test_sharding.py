"""Slices of the global batch per data-parallel rank, from an explicit rank or the torchrun runtime."""

from __future__ import annotations

import pytest

from twinkle.dataloader import DataLoader
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.infra import DeviceGroup, DeviceMesh, initialize

ROWS = list(range(40))


def _batches(**kwargs) -> list[list[int]]:
    return [list(batch) for batch in DataLoader(ROWS, batch_size=16, shuffle=True, **kwargs)]


def test_eight_dp_ranks_each_get_two_rows_of_a_batch_of_sixteen():
    mesh = DeviceMesh.from_sizes(dp_size=8)
    full = _batches(device_mesh=mesh)  # one process and no rank: the whole batch (as a Ray driver sees it)
    assert [len(batch) for batch in full] == [16, 16, 8]
    for rank in range(8):
        sliced = _batches(device_mesh=mesh, rank=rank)
        assert [batch for batch in sliced] == [batch[2 * rank : 2 * rank + 2] for batch in full[:2]] + [
            full[2][rank : rank + 1]
        ]


def test_tensor_parallel_peers_share_a_slice_and_dp_slices_tile_the_batch():
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2)  # ranks 0,1 are dp 0; ranks 2,3 are dp 1
    full = _batches(device_mesh=mesh)
    per_rank = [_batches(device_mesh=mesh, rank=rank) for rank in range(4)]
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]
    assert [a + b for a, b in zip(per_rank[0], per_rank[2], strict=True)] == full


def test_torchrun_process_takes_its_own_slice(torchrun):
    mesh = DeviceMesh.from_sizes(dp_size=4)
    full = _batches()
    torchrun(rank=3, world_size=4)
    assert _batches(device_mesh=mesh) == [batch[12:16] for batch in full[:2]] + [full[2][6:8]]
    assert _batches() == full  # no mesh: every process sees whole batches


def test_torchrun_process_slices_by_the_global_device_mesh_by_default(torchrun):
    full = _batches()
    torchrun(rank=1, world_size=2)
    initialize("local", global_device_mesh=DeviceMesh.from_sizes(dp_size=2))  # as a script sets it for every component
    assert _batches() == [batch[8:16] for batch in full[:2]] + [full[2][4:8]]


def test_torchrun_rank_is_translated_into_the_device_group(torchrun):
    mesh = DeviceMesh.from_sizes(dp_size=4)
    groups = [DeviceGroup("sampler", ranks=[0, 1, 2, 3]), DeviceGroup("model", ranks=[4, 5, 6, 7])]
    full = _batches()
    torchrun(rank=6, world_size=8, groups=groups)
    assert _batches(device_mesh=mesh, remote_group="model") == [batch[8:12] for batch in full[:2]] + [full[2][4:6]]
    with pytest.raises(
        ConfigurationError, match=r"process rank 6 .* group 'sampler', which holds ranks \[0, 1, 2, 3\]"
    ):
        DataLoader(ROWS, batch_size=16, device_mesh=mesh, remote_group="sampler")


def test_short_last_batch_is_dropped_when_a_rank_would_get_nothing():
    mesh = DeviceMesh.from_sizes(dp_size=4)
    loader = DataLoader(list(range(10)), batch_size=4, device_mesh=mesh, rank=0)
    assert len(loader) == 2  # the 2-row remainder cannot feed 4 ranks
    assert [list(batch) for batch in loader] == [[0], [4]]


def test_mesh_argument_errors():
    mesh = DeviceMesh.from_sizes(dp_size=8)
    with pytest.raises(ConfigurationError, match="batch_size=4 is smaller than the 8 data-parallel ranks"):
        DataLoader(ROWS, batch_size=4, device_mesh=mesh)
    with pytest.raises(ConfigurationError, match=r"rank=1.* needs a device_mesh"):
        DataLoader(ROWS, batch_size=4, rank=1)
    with pytest.raises(InvalidInputError, match="rank 8 is outside this mesh"):
        DataLoader(ROWS, batch_size=16, device_mesh=mesh, rank=8)
