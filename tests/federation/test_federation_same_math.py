"""The MQTT federation computes exactly what the simulator computes: real broker, real agent processes, same weights.

A small simulation config is partitioned with ``feast-edge partition`` (so every
agent trains on exactly the simulator's shard, with the simulator's budget and
client id); a server (in this process) and three ``feast-agent run`` processes
federate for two rounds through the Mosquitto at 127.0.0.1:1883; the final
global weights must equal those of ``Simulation(config).run()``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT
from feast_edge.server.registry import Registry
from feast_edge.sim.shards import read_index
from feast_edge.sim.simulate import Simulation

# A simulation and a federation of real agent processes through the broker at 127.0.0.1:1883.
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(600)]

# --------------------------------------------------------------------------- the federation under test


@pytest.fixture(scope="module")
def simulation(kit, tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> dict[str, torch.Tensor]:
    return kit.simulated_weights(kit.CONFIG, tmp_path_factory.mktemp("simulation"))


@pytest.fixture(scope="module")
def federated(kit, tmp_path_factory: pytest.TempPathFactory, partition: Path) -> Iterator[dict]:
    """Server thread + 3 agent processes, 2 rounds; yields what the tests inspect, then stops everything."""
    assert kit.port_open(1883), (
        "no MQTT broker at 127.0.0.1:1883: start it with 'mosquitto -d -c /etc/mosquitto/mosquitto.conf'"
    )
    fed = kit.new_federation()
    out = tmp_path_factory.mktemp("federation")
    server = kit.ServerThread(kit.server_config(kit.CONFIG, out, partition, fed)).start()
    agents = {}
    try:
        for entry in read_index(partition)["clients"]:
            cid = entry["client_id"]
            agents[cid] = kit.spawn_agent(
                out / "logs", cid, partition / entry["file"], fed, "--model-dir", str(out / "received")
            )
        history = server.join(timeout=300)
        yield {"out": out, "history": history, "server": server, "agents": agents, "federation": fed}
    finally:
        codes = {cid: kit.stop(p) for cid, p in agents.items()}
        server.close()
        kit.clear_retained(fed)
    assert all(code == 0 for code in codes.values()), f"agents did not leave cleanly on SIGTERM: {codes}"


def test_final_global_weights_equal_the_simulation(kit, federated: dict, simulation: dict[str, torch.Tensor]) -> None:
    got = kit.weights(federated["out"] / CHECKPOINT)
    diff = kit.max_abs_diff(got, simulation)
    assert diff <= 1e-6, f"MQTT federation and simulation differ by {diff}"
    assert all(torch.equal(got[k], simulation[k]) for k in got), f"equal within {diff}, but not bit-exact"


def test_rounds_use_the_simulators_cohorts_and_every_update(kit, federated: dict, tmp_path: Path) -> None:
    sim = Simulation(kit.CONFIG, tmp_path)
    history = federated["history"]
    assert [h.round for h in history] == [1, 2]
    for t, h in enumerate(history):
        assert h.cohort == sim.run_round(t).cohort
        assert h.updated == h.cohort and h.applied and not h.rejected and not h.missing
        assert h.val_accuracy is not None and 0 <= h.val_accuracy <= 1
    fields = read_record(federated["out"] / CHECKPOINT)["fields"]
    assert fields["round"] == 2 and fields["seed"] == kit.CONFIG.seed and len(fields["registry"]) == 3


def test_registry_holds_every_device_with_its_budget_and_samples(federated: dict, partition: Path) -> None:
    registry = Registry(federated["out"] / "devices.sqlite")
    devices = {d.device_id: d for d in registry.devices()}
    registry.close()
    for entry in read_index(partition)["clients"]:
        d = devices[entry["client_id"]]
        assert d.budget_macs == int(entry["budget_macs"]) and d.samples == entry["samples"]
        assert d.first_seen <= d.last_seen and d.instance and d.host == entry["client_id"]
    assert sum(d.rounds for d in devices.values()) == sum(len(h.updated) for h in federated["history"])


def test_export_announces_each_device_its_model_and_fetch_model_verifies_it(
    kit, federated: dict, tmp_path: Path
) -> None:
    server = federated["server"].server
    manifests = server.export()
    assert [m["device"] for m in manifests] == sorted(federated["agents"])
    for m in manifests:
        entry = server.cache.largest_affordable(m["budget_macs"])
        assert m["macs"] == entry.macs and m["arch"] == entry.arch.to_dict() and 0 <= m["validation_accuracy"] <= 1
        blob = (federated["out"] / "models" / m["file"]).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == m["sha256"]
    assert sorted(server.announce_models(manifests)) == sorted(federated["agents"])
    received = federated["out"] / "received"
    served = threading.Thread(target=server.serve, kwargs={"seconds": 90.0}, daemon=True)
    served.start()
    try:
        assert kit.wait_for(lambda: all((received / f"{d}.onnx").is_file() for d in federated["agents"]), timeout=60), (
            "agents did not save their pushed models"
        )
        for m in manifests:
            assert hashlib.sha256((received / m["file"]).read_bytes()).hexdigest() == m["sha256"]
        target = manifests[-1]["device"]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "feast_edge.agent.cli",
                "fetch-model",
                "--broker",
                kit.LOCAL,
                "--device-id",
                target,
                "--out",
                str(tmp_path / "m.onnx"),
                "--federation",
                federated["federation"],
                "--timeout",
                "30",
                "--repeats",
                "10",
            ],
            cwd=kit.REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.stop.set()
        served.join(30)
        server.stop.clear()
    assert result.returncode == 0, result.stderr
    assert "verified" in result.stdout and "onnxruntime latency" in result.stdout
    assert hashlib.sha256((tmp_path / "m.onnx").read_bytes()).hexdigest() == manifests[-1]["sha256"]
    assert json.loads((tmp_path / "m.json").read_text())["device"] == target
