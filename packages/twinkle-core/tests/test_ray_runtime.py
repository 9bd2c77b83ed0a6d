"""mode='ray': dispatch and collection over data-parallel actors, placement, errors, lazy results, relay.

One local 2-CPU Ray for the whole module; its device group ``pair`` (two CPU
ranks) holds every actor, so the cluster has no CPU to spare for ``big``.
"""

import gc
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import twinkle  # noqa: E402
from twinkle import DeviceGroup, DeviceMesh  # noqa: E402
from twinkle.data_format import SampledSequence, SampleResponse  # noqa: E402
from twinkle.errors import ConfigurationError, InvalidInputError  # noqa: E402
from twinkle.infra import get_runtime, process_group_kwargs, remote_class, shutdown  # noqa: E402
from twinkle.infra.ray import ActorProxy, LazyResult, relay  # noqa: E402
from twinkle.infra.ray.actors import wait_for_unresolved_calls  # noqa: E402
from twinkle.infra.ray.dispatch import data_leaders, merge, split_arguments, worker_ranks  # noqa: E402
from twinkle.infra.ray.placement import bundles_for  # noqa: E402

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
TWO_WORKERS = DeviceMesh.from_sizes(dp_size=2)


@dataclass
class Output:
    loss: float
    values: list
    num_tokens: int


@remote_class
class Worker:
    def __init__(self, scale: float = 1.0, device_mesh: DeviceMesh | None = None) -> None:
        if scale < 0:
            raise InvalidInputError("scale must be >= 0")
        self.scale = scale
        self.received = None

    @property
    def rank(self) -> int:
        return get_runtime().rank

    def forward(self, inputs: list, weights: list, offset: float = 0.0) -> Output:
        values = [(x * w + offset) * self.scale for x, w in zip(inputs, weights, strict=True)]
        return Output(loss=float(len(inputs) * (get_runtime().rank + 1)), values=values, num_tokens=len(inputs))

    def set_scale(self, scale: float) -> int:
        self.scale = scale
        return get_runtime().rank

    def fail(self) -> None:
        raise InvalidInputError("no such sample")

    def write_after(self, path: str, seconds: float) -> None:
        time.sleep(seconds)
        Path(path).write_text(f"rank {get_runtime().rank}")

    def all_reduce(self, value: float) -> float:
        """What a DDP model does: join torch.distributed from torchrun's variables and sum over the workers."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", **process_group_kwargs())
        total = torch.tensor([value * (dist.get_rank() + 1)])
        dist.all_reduce(total)
        return total.item()


@pytest.fixture(scope="module")
def runtime():
    runtime = twinkle.initialize(
        mode="ray",
        seed=3,
        groups=[DeviceGroup("pair", ranks=[0, 1]), DeviceGroup("big", ranks=3)],
        lazy_collect=False,
        num_cpus=2,
        placement_timeout_s=2,
    )
    yield runtime
    shutdown()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def pair(runtime):
    return Worker(2.0, remote_group="pair", device_mesh=TWO_WORKERS)


def test_split_arguments_slices_per_sample_values_and_shares_the_rest():
    shares = split_arguments(([1, 2, 3], "shared"), {"w": (4, 5, 6), "k": 7}, TWO_WORKERS, [0, 1], "m")
    assert shares == [(([1, 2], "shared"), {"w": (4, 5), "k": 7}), (([3], "shared"), {"w": (6,), "k": 7})]
    with pytest.raises(InvalidInputError, match=r"m: per-sample arguments differ in length"):
        split_arguments(([1, 2, 3],), {"w": [1]}, TWO_WORKERS, [0, 1], "m")
    with pytest.raises(InvalidInputError, match=r"m: 1 sample\(s\) cannot be split over 2"):
        split_arguments(([1],), {}, TWO_WORKERS, [0, 1], "m")
    with pytest.raises(InvalidInputError, match="pass the batch as a list"):
        split_arguments(({"input_ids": [1]},), {}, TWO_WORKERS, [0, 1], "m")


def test_merge_concatenates_per_sample_values_and_takes_scalars_from_the_first_worker():
    merged = merge([Output(1.0, [1, 2, 3], 3), Output(1.0, (4,), 3)])
    assert merged == Output(loss=1.0, values=[1, 2, 3, 4], num_tokens=3)  # a model reports global scalars
    assert merge([{"logps": [[0.1]], "kl": 0.5}, {"logps": [[0.2]], "kl": 0.5}]) == {"logps": [[0.1], [0.2]], "kl": 0.5}


def test_merged_sample_responses_are_prompt_major_over_every_worker():
    """Two sampler workers each answer their share of ``[p, q] * 2``: the merged response groups p, then q."""
    share = SampleResponse(
        [SampledSequence([7], "stop", input_index=0), SampledSequence([8], "stop", input_index=1)],
        prompt_token_ids=[[1], [2]],
    )
    merged = merge([share, share])
    assert [(s.tokens, s.input_index) for s in merged.sequences] == [([7], 0), ([7], 2), ([8], 1), ([8], 3)]
    assert merged.prompt_token_ids == [[1], [2], [1], [2]]


def test_a_worker_per_rank_or_per_share_of_the_batch_and_one_result_per_share():
    mesh = DeviceMesh.from_sizes(dp_size=2, fsdp_size=2, tp_size=2)
    assert worker_ranks(None) == [0] and data_leaders(None, [0]) == [0]
    assert worker_ranks(mesh) == list(range(8))  # tp peers are processes of their own, as under torchrun
    assert data_leaders(mesh, worker_ranks(mesh)) == [0, 2, 4, 6]
    assert worker_ranks(mesh, every_rank=False) == [0, 2, 4, 6]  # a component that joins no process group
    shares = split_arguments(([1, 2, 3, 4],), {}, mesh, worker_ranks(mesh), "m")
    assert [args for args, _ in shares] == [([n],) for n in (1, 1, 2, 2, 3, 3, 4, 4)]  # tp peers: the same share
    pipeline = DeviceMesh.from_sizes(pp_size=2, dp_size=2)  # pp is the slowest dimension: stage 1 is ranks 2, 3
    assert data_leaders(pipeline, worker_ranks(pipeline)) == [0, 1]
    ulysses = DeviceMesh.from_sizes(fsdp_size=4, ulysses_size=2)  # Ulysses peers share their samples
    assert data_leaders(ulysses, worker_ranks(ulysses)) == [0, 2]
    # A worker with 2 devices takes 2 ranks: its tensor-parallel peers (one engine's tensor parallelism).
    assert worker_ranks(mesh, ranks_per_worker=2) == [0, 2, 4, 6]
    assert data_leaders(mesh, [0, 2, 4, 6]) == [0, 1, 2, 3]
    with pytest.raises(ConfigurationError, match=r"2 must divide tp_size\*cp_size=1"):
        worker_ranks(DeviceMesh.from_sizes(dp_size=2), ranks_per_worker=2)


def test_bundles_per_rank_on_cpu_and_per_worker_on_gpu():
    assert bundles_for(DeviceGroup("c", ranks=2)) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert bundles_for(DeviceGroup("g", ranks=4, device_type="GPU", gpus_per_worker=2)) == [{"GPU": 2.0}] * 2
    with pytest.raises(ConfigurationError, match="not a multiple of gpus_per_worker=2"):
        bundles_for(DeviceGroup("g", ranks=3, device_type="GPU", gpus_per_worker=2))


def test_data_methods_are_split_over_workers_and_merged_in_order(pair):
    assert isinstance(pair, ActorProxy)
    output = pair.forward([1, 2, 3], weights=[1, 10, 100], offset=0.5)
    assert output.values == [3.0, 41.0, 601.0]  # worker 0 got samples 0-1, worker 1 sample 2, in order
    assert (output.loss, output.num_tokens) == (2.0, 2)  # worker 0's (a real model reports global figures)


def test_workers_form_a_torchrun_like_group_for_torch_distributed_listening_on_127_0_0_1_only(pair):
    pytest.importorskip("torch")
    assert pair.all_reduce(1.0) == 3.0  # 1 * (rank 0 + 1) + 1 * (rank 1 + 1)
    # With the group up, every socket a Ray worker listens on (gloo's included; no TCP store) is on loopback.
    out = subprocess.run(["ss", "-tnlpH"], capture_output=True, text=True, check=True).stdout
    listening = [line.split()[3].rpartition(":")[0] for line in out.splitlines() if '(("ray::' in line]
    assert listening and set(listening) <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, listening  # IPv4, or IPv4-mapped


def test_other_methods_run_on_every_worker_and_return_the_first_result(pair):
    assert pair.set_scale(3.0) == 0  # worker 0's answer
    assert pair.forward([1, 1], weights=[1, 1]).values == [3.0, 3.0]  # both replicas were updated
    pair.set_scale(2.0)
    assert (pair.scale, pair.rank) == (2.0, 0)  # attributes and properties come from worker 0


def test_worker_exceptions_keep_their_type_and_name_the_call(runtime, pair):
    with pytest.raises(InvalidInputError, match=r"^Worker\.fail \(worker 0 on group 'pair'\): no such sample$"):
        pair.fail()
    with pytest.raises(InvalidInputError, match=r"Worker\.__init__ .*scale must be >= 0"):
        Worker(-1.0, remote_group="pair")


def test_lazy_calls_return_futures_and_failures_surface_at_a_later_use(runtime, monkeypatch):
    monkeypatch.setattr(runtime, "lazy_collect", True)
    worker = Worker(1.0, remote_group="pair")
    future = worker.forward([2], weights=[3])
    assert isinstance(future, LazyResult)
    assert future.values == [6.0] and future.result().num_tokens == 1
    worker.fail()  # never looked at
    worker.set_scale(1.0).result()  # runs after it: calls to one actor keep their order
    with pytest.raises(InvalidInputError, match=r"Worker\.fail"):
        worker.set_scale(2.0)
    broken = Worker(-1.0, remote_group="pair")  # lazily built: its constructor's error comes with its first use
    with pytest.raises(InvalidInputError, match=r"Worker\.__init__ .*scale must be >= 0"):
        broken.set_scale(1.0).result()


def test_lazy_calls_nobody_resolved_finish_after_their_proxy_is_gone(runtime, monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "lazy_collect", True)
    wait_for_unresolved_calls()  # earlier tests' leftovers
    worker = Worker(1.0, remote_group="pair")
    worker.write_after(str(tmp_path / "written"), 1.0)
    worker.fail()
    del worker
    gc.collect()  # the proxy is gone, its calls are not: Ray runs an actor's queued calls before it stops it
    errors = wait_for_unresolved_calls()
    assert (tmp_path / "written").read_text() == "rank 0"
    assert len(errors) == 1 and isinstance(errors[0], InvalidInputError) and "Worker.fail" in str(errors[0])
    assert wait_for_unresolved_calls() == []


def test_a_script_that_ends_without_resolving_its_last_call_still_has_it_done(tmp_path):
    """As a training script's last ``model.save(...)``: lazy by default, and nothing waits for it but the exit."""
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        import twinkle
        from twinkle.infra import remote_class

        @remote_class
        class Writer:
            def write(self, path):
                time.sleep(2)
                Path(path).write_text("written")

        twinkle.initialize(mode="ray", groups=[twinkle.DeviceGroup("one", ranks=1)], num_cpus=1)
        Writer(remote_group="one").write({str(tmp_path / "out")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=180, capture_output=True)
    assert (tmp_path / "out").read_text() == "written"


def test_relay_moves_a_value_actor_to_actor_with_only_a_reference_through_the_driver(pair, monkeypatch):
    import twinkle.infra.ray.actors as actors

    target = Worker(remote_group="pair")
    seen_by_driver = []
    real_get = actors.ray.get

    def recording_get(ref, **kwargs):
        value = real_get(ref, **kwargs)
        seen_by_driver.append(value)
        return value

    monkeypatch.setattr(actors.ray, "get", recording_get)
    assert relay(pair, target, _big_payload, _receive)  # both of pair's workers read (else the collective hangs)
    monkeypatch.undo()
    assert seen_by_driver  # the driver saw the first worker's reference, the others' [] and the receivers' None
    assert [v for v in seen_by_driver if isinstance(v, list) and v and isinstance(v[0], ray.ObjectRef)]
    assert all(v in (None, []) or isinstance(v[0], ray.ObjectRef) for v in seen_by_driver)  # never the megabyte
    assert target.received == 999_999
    assert relay(object(), object(), _big_payload, _receive) is False  # in-process: the caller's job


def test_components_without_a_group_stay_in_the_driver_and_placement_is_described(runtime, pair):
    local = Worker(5.0)
    assert type(local) is Worker and local.remote_group == "driver"
    text = twinkle.get_device_placement()
    assert "group 'pair': ranks=[0, 1] device=cpu: Ray placement group" in text
    assert "[{'CPU': 1.0}, {'CPU': 1.0}]" in text
    assert "- Worker: 2 actor(s) mesh dp=2" in text
    assert "group 'big': ranks=[0, 1, 2] device=cpu: no placement group yet" in text
    assert "driver (this process):\n    - Worker" in text


def test_a_group_the_cluster_cannot_hold_is_a_clear_error(runtime, pair):
    with pytest.raises(ConfigurationError, match=r"device group 'big' needs \{'CPU': 3.0\} in 3 bundle\(s\)"):
        Worker(remote_group="big")
    with pytest.raises(ConfigurationError, match="device_mesh spans 4 ranks, but device group 'pair' has 2"):
        Worker(remote_group="pair", device_mesh=DeviceMesh.from_sizes(dp_size=4))


def test_mode_ray_without_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'twinkle-core\[ray\]'") as error:
        twinkle.initialize(mode="ray")
    assert isinstance(error.value, ImportError)


def test_importing_twinkle_and_loading_the_plugin_does_not_import_ray():
    code = (
        "import sys; from importlib.metadata import entry_points; import twinkle.infra.ray; "
        "[ep.load() for ep in entry_points(group='twinkle.runtime')]; assert 'ray' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _big_payload(component: Worker) -> bytes:
    """A megabyte, read as a sharded model's weights are: with a collective of the source's workers (1 + 2)."""
    return bytes(1_000_000 // 3 * int(component.all_reduce(1.0)))


def _receive(component: Worker, payload: bytes) -> None:
    component.received = len(payload)
