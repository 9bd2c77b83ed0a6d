"""``twinkle server --ray --replicas 2``: four tenants on two Ray replicas, and one replica killed mid-call.

The model is a Ray Serve deployment of two replicas. Each run lives on one
replica (two adapters each) and trains exactly as it does alone in-process; a
dead replica fails only its own tenants' calls, they resume from their
checkpoints on a live replica, the others never notice, and Serve starts a
replacement. Every socket is on 127.0.0.1 and the server's Ray processes end
with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from twinkle.model import MultiLoraModel
from twinkle_client.http import TwinkleClient

sys.path.insert(0, str(Path(__file__).parent))
from harness import LR, SoloReference, batch, call_body, new_run

pytestmark = pytest.mark.integration

TENANTS = ["t0", "t1", "t2", "t3"]
SEEDS = {tenant: 20 + i for i, tenant in enumerate(TENANTS)}
STEPS = 3  # step 0 and 1 before the checkpoint, step 2 after the kill


def test_ray_replicas_route_by_adapter_and_survive_a_dead_replica(start_server):
    server = start_server(TENANTS, args=["--ray", "--replicas", "2"], max_loras=4)
    clients = {t: TwinkleClient(server.url, server.keys[t]) for t in TENANTS}
    runs = {t: new_run(clients[t], SEEDS[t]) for t in TENANTS}

    replicas = _replicas(server.url)
    assert [len(r["runs"]) for r in replicas] == [2, 2]
    assert [sorted(r["adapters"]) for r in replicas] == [r["runs"] for r in replicas]  # as the replicas report
    assert sorted(run for r in replicas for run in r["runs"]) == sorted(runs.values())  # one replica per run

    references = _references(SEEDS)
    with ThreadPoolExecutor(len(TENANTS)) as pool:  # tenants train at once, each on its replica
        losses = dict(zip(TENANTS, pool.map(lambda t: _train(clients[t], runs[t], t, range(2)), TENANTS), strict=True))
    for tenant in TENANTS:
        assert losses[tenant] == pytest.approx(references[tenant][:2], abs=1e-5), tenant
        clients[tenant].call(runs[tenant], "save", name="step-1", save_optimizer=True)

    victim = replicas[0]
    doomed = [t for t in TENANTS if runs[t] in victim["runs"]]
    spared = [t for t in TENANTS if t not in doomed]
    # Long batches keep the victims' calls in flight (queued or running) when the replica dies.
    futures = {
        t: clients[t].request("POST", f"/runs/{runs[t]}/call", call_body("forward_backward", inputs=_long(t)))[
            "future_id"
        ]
        for t in doomed
    }
    os.kill(victim["pid"], signal.SIGKILL)
    with ThreadPoolExecutor(len(spared)) as pool:  # the other replica's tenants carry on undisturbed
        spared_losses = dict(zip(spared, pool.map(lambda t: _train(clients[t], runs[t], t, [2]), spared), strict=True))
    for tenant in spared:
        assert spared_losses[tenant] == pytest.approx(references[tenant][2:], abs=1e-5), tenant

    for tenant in doomed:
        state = clients[tenant].request("GET", f"/futures/{futures[tenant]}?wait=60")
        assert state["status"] == "failed", state
        assert state["error"]["type"] == "ServerError"
        assert "replica holding run" in state["error"]["message"] and "resume" in state["error"]["message"]
        assert clients[tenant].get_run(runs[tenant])["resident"] is False
        clients[tenant].resume_run(runs[tenant])
        clients[tenant].call(runs[tenant], "set_optimizer", optimizer_cls="AdamW", lr=LR)
        clients[tenant].call(runs[tenant], "load", path="step-1", load_optimizer=True)
        assert _train(clients[tenant], runs[tenant], tenant, [2]) == pytest.approx(references[tenant][2:], abs=1e-5)

    after = _replicas(server.url)
    assert not after[0]["alive"] and after[0]["runs"] == []
    assert sorted(run for r in after if r["alive"] for run in r["runs"]) == sorted(runs.values())  # resumed live
    # Serve replaces the dead replica; the replacement joins (with no runs but the resumed ones it took).
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and sum(r["alive"] for r in after) < 2:
        time.sleep(1)
        after = _replicas(server.url)
    assert [(r["index"], r["alive"]) for r in after] == [(0, False), (1, True), (2, True)], after
    assert sorted(after[2]["adapters"]) == after[2]["runs"]

    tree = _descendants(server.pid)
    assert len(tree) >= 3, tree  # Ray's processes (GCS, raylet, the live replica, ...) are the server's
    listening = _listening(tree | {server.pid})
    assert listening and all(_host(address) == "127.0.0.1" for address in listening), listening

    for client in clients.values():
        client.close()
    server.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(tree):
        time.sleep(0.5)
    assert not _alive(tree), f"Ray processes left running: {_alive(tree)}"


def _train(client: TwinkleClient, run_id: str, tenant: str, steps: range | list[int]) -> list[float]:
    losses = []
    for step in steps:
        losses.append(client.call(run_id, "forward_backward", inputs=batch(tenant, step))["loss"])
        client.call(run_id, "clip_grad_and_step")
    return losses


def _long(tenant: str) -> list[dict]:
    return batch(f"{tenant}-long", 0, samples=4, length=1024)


def _references(seeds: dict[str, int]) -> dict[str, list[float]]:
    """Each tenant's losses for every step, trained alone in this process."""
    model, losses = MultiLoraModel(device="cpu"), {}
    for tenant, seed in seeds.items():
        solo = SoloReference(seed, model, name=tenant)
        losses[tenant] = solo.train([batch(tenant, step) for step in range(STEPS)])
        solo.close()
    return losses


def _replicas(url: str) -> list[dict]:
    return httpx.get(f"{url}/admin/replicas", timeout=60).json()["replicas"]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _listening(pids: set[int]) -> list[str]:
    """The local addresses of the TCP sockets ``pids`` listen on (``ss -tnlp``)."""
    out = subprocess.run(["ss", "-tnlpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]


def _host(address: str) -> str:
    """``127.0.0.1`` for ``127.0.0.1:80`` and for the IPv4-mapped ``[::ffff:127.0.0.1]:80`` alike."""
    return address.rpartition(":")[0].strip("[]").removeprefix("::ffff:")


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
