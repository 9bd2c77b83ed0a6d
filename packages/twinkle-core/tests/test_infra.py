import pytest

import twinkle
from twinkle import DeviceGroup
from twinkle.errors import ConfigurationError
from twinkle.infra import get_runtime, process_group_kwargs, remote_class


@remote_class
class Counter:
    def __init__(self, start: int = 0, device_mesh=None):
        self.value = start
        self.device_mesh = device_mesh


def test_local_component_is_the_plain_object_and_is_placed():
    twinkle.initialize(seed=0, groups=[DeviceGroup("model", ranks=1)])
    counter = Counter(3, remote_group="model")
    assert type(counter) is Counter and counter.value == 3 and counter.remote_group == "model"
    assert "Counter" in twinkle.get_device_placement()


def test_unknown_remote_group_is_a_clear_error():
    twinkle.initialize(seed=0)
    with pytest.raises(ConfigurationError, match=r"remote_group 'sampler' is not a device group.*\['default'\]"):
        Counter(remote_group="sampler")


def test_torchrun_environment_is_detected(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    runtime = twinkle.initialize(seed=0)
    assert (runtime.rank, runtime.world_size, runtime.is_torchrun) == (1, 2, True)
    assert not twinkle.is_master()
    assert runtime.groups["default"].ranks == [0, 1]


def test_process_group_kwargs_are_torchruns_env_unless_a_file_store_is_given(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert process_group_kwargs() == {}  # torch's default, env://
    monkeypatch.setenv("TWINKLE_DIST_INIT_METHOD", "file:///tmp/store")  # what Ray workers on one node get
    assert process_group_kwargs() == {"init_method": "file:///tmp/store", "rank": 1, "world_size": 2}


def test_unknown_mode_lists_installed_modes():
    with pytest.raises(ConfigurationError, match=r"mode='warp' is not available.*\['local'"):
        twinkle.initialize(mode="warp")


def test_initialize_seeds_python_random():
    import random

    twinkle.initialize(seed=123)
    first = random.random()
    twinkle.initialize(seed=123)
    assert random.random() == first
    assert get_runtime().seed == 123


def test_duplicate_group_names_rejected():
    with pytest.raises(ConfigurationError, match="duplicate device group name 'a'"):
        twinkle.initialize(groups=[DeviceGroup("a", 1), DeviceGroup("a", 2)])


def test_first_component_does_not_reseed(monkeypatch):
    """Building a component without initialize() must not touch the user's RNG stream."""
    import random

    import twinkle.infra as infra

    monkeypatch.setattr(infra, "_runtime", None)
    random.seed(7)
    expected = [random.random() for _ in range(2)]
    random.seed(7)
    first = random.random()
    Counter()
    assert [first, random.random()] == expected
