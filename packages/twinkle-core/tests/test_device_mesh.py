import pytest

from twinkle import DeviceGroup, DeviceMesh
from twinkle.errors import ConfigurationError, InvalidInputError


def test_from_sizes_infers_dp_and_orders_tp_fastest():
    mesh = DeviceMesh.from_sizes(world_size=8, fsdp_size=2, tp_size=2)
    assert mesh.sizes == {"pp": 1, "dp": 2, "fsdp": 2, "cp": 1, "tp": 2}
    assert mesh.coords(1) == {"pp": 0, "dp": 0, "fsdp": 0, "cp": 0, "tp": 1}
    assert mesh.group_ranks("tp", 4) == [4, 5]
    assert mesh.group_ranks("dp", 1) == [1, 5]
    assert all(mesh.rank_of(**mesh.coords(r)) == r for r in range(8))


def test_seed_mesh_without_world_size():
    mesh = DeviceMesh.from_sizes(fsdp_size=4, dp_size=2)
    assert mesh.world_size == 8 and mesh.data_world_size == 8


def test_torchrun_slices_match_the_seed_example():
    # "eight cards with ddp: each card gets [0~1], [2~3], ... [14~15]"
    mesh = DeviceMesh.from_sizes(world_size=8, dp_size=8)
    assert [mesh.get_slice(16, r) for r in range(8)] == [slice(2 * r, 2 * r + 2) for r in range(8)]


def test_slices_cover_uneven_totals_and_tp_peers_share_data():
    mesh = DeviceMesh.from_sizes(dp_size=3, tp_size=2)
    slices = [mesh.get_slice(7, r) for r in range(mesh.world_size)]
    assert slices[0] == slices[1] == slice(0, 3)
    covered = [i for s in slices[::2] for i in range(s.start, s.stop)]
    assert covered == list(range(7))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "fsdp_size": 4}, "not divisible"),
        ({"world_size": 4, "dp_size": 2, "tp_size": 1}, "does not equal the product"),
        ({"dp_size": 0}, "dp_size must be >= 1"),
        ({"dp_size": 4, "ep_size": 3}, "ep_size=3 must divide"),
        ({"fsdp_size": 4, "ulysses_size": 3}, r"ulysses_size=3 must divide the data-parallel size dp\*fsdp=4"),
        ({"tp_size": 2, "ulysses_size": 2}, r"ulysses_size=2 must divide the data-parallel size dp\*fsdp=1"),
        ({"device_type": "tpu"}, "unknown device_type"),
    ],
)
def test_bad_mesh_sizes(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        DeviceMesh.from_sizes(**kwargs)


def test_ulysses_groups_share_samples_and_split_their_tokens():
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, ulysses_size=2)
    assert mesh.world_size == 4 and mesh.dp_fsdp_size == 4 and mesh.data_world_size == 2
    assert mesh.ulysses_groups() == [[0, 1], [2, 3]]
    assert [mesh.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [mesh.ulysses_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [mesh.get_slice(6, r) for r in range(4)] == [slice(0, 3), slice(0, 3), slice(3, 6), slice(3, 6)]
    assert mesh.size("ulysses") == 2


def test_ulysses_groups_stay_within_tensor_parallel_coordinates():
    mesh = DeviceMesh.from_sizes(fsdp_size=2, tp_size=2, ulysses_size=2)
    assert mesh.ulysses_groups() == [[0, 2], [1, 3]]  # tp varies fastest: ranks 0, 2 hold the same tp shard
    assert mesh.data_world_size == 1


def test_rank_out_of_range():
    with pytest.raises(InvalidInputError, match="outside this mesh"):
        DeviceMesh.from_sizes(dp_size=2).coords(2)


def test_mesh_dict_round_trip():
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2, ep_size=2, ulysses_size=2, device_type="GPU")
    assert DeviceMesh.from_dict(mesh.to_dict()) == mesh
    assert mesh.device_type == "cuda"


def test_device_group_accepts_count_or_list():
    assert DeviceGroup("model", ranks=4, device_type="GPU").ranks == [0, 1, 2, 3]
    assert DeviceGroup("sampler", ranks=[4, 5]).world_size == 2
    with pytest.raises(ConfigurationError, match="distinct"):
        DeviceGroup("bad", ranks=[1, 1])
