"""The MQTT federation computes exactly what the simulator computes: real broker, real agent processes, same weights.

A small simulation config is partitioned with ``feast-edge partition`` (so every
agent trains on exactly the simulator's shard, with the simulator's budget and
client id); a server (in this process) and three ``feast-agent run`` processes
federate for two rounds through the Mosquitto at 127.0.0.1:1883; the final
global weights must equal those of ``Simulation(config).run()``.

The helpers here (server thread, agent processes, retained-status cleanup) are
shared by the other federation test modules.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from feast_edge.checkpoint import load_supernet, read_record
from feast_edge.shards import read_index, write_partition
from feast_edge.simulate import Simulation, SimulationConfig
from feast_edge.transport.link import Link, LinkConfig
from feast_edge.server.federation import CHECKPOINT, FederationServer, RoundRecord, ServerConfig
from feast_edge.server.registry import Registry

REPO = Path(__file__).resolve().parents[2]
LOCAL = "mqtt://127.0.0.1:1883"
CONFIG = SimulationConfig(
    clients=3,
    per_round=2,
    rounds=2,
    train_limit=300,
    val_samples=100,
    calib_samples=50,
    test_limit=50,
    eval_every=2,
    batch_size=32,
    seed=3,
)


# --------------------------------------------------------------------------- shared helpers


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def new_federation() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def clear_retained(federation: str, broker: str = LOCAL) -> None:
    """Remove the retained presence messages a test federation left on the shared broker."""
    link = Link(LinkConfig(broker=broker))
    topics: list[str] = []
    link.subscribe(f"feast/{federation}/#", lambda r: topics.append(r.topic) if r.retain and r.payload else None)
    link.connect(timeout=5)
    time.sleep(0.5)
    for topic in set(topics):
        link.publish(topic, b"", retain=True, timeout=5)
    link.close()


@pytest.fixture
def federation() -> Iterator[str]:
    assert port_open(1883), "no MQTT broker at 127.0.0.1:1883: start it with 'mosquitto -d -c /etc/mosquitto/mosquitto.conf' (.ci/run does)"
    fed = new_federation()
    yield fed
    clear_retained(fed)


class ServerThread:
    """A FederationServer running its rounds in a background thread of the test process."""

    def __init__(self, config: ServerConfig, broker: str = LOCAL, export: bool = False) -> None:
        self.server = FederationServer(config, LinkConfig(broker=broker))
        self.export = export
        self.history: list[RoundRecord] | None = None
        self.manifests: list[dict] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="feast-server", daemon=True)

    def _run(self) -> None:
        try:
            self.history = self.server.run()
            if self.export:
                self.manifests = self.server.export()
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def start(self) -> "ServerThread":
        self.server.start(timeout=5)
        self.thread.start()
        return self

    def join(self, timeout: float) -> list[RoundRecord]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the server did not finish within {timeout} s"
        if self.error is not None:
            raise self.error
        assert self.history is not None
        return self.history

    def close(self) -> None:
        self.server.stop.set()
        self.thread.join(30)
        self.server.close()


def spawn_agent(logs: Path, device_id: str, data: Path | str, federation: str, *extra: str, broker: str = LOCAL) -> subprocess.Popen:
    """A real ``feast-agent run`` process, logging to ``logs/agent-<id>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / f"agent-{device_id}.log", "w")
    cmd = [
        sys.executable, "-m", "feast_edge.agent.cli", "run", "--broker", broker, "--device-id", device_id, "--data", str(data),
        "--federation", federation, "--threads", "1", "--register-timeout", "120", *extra,
    ]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    process.log_path = logs / f"agent-{device_id}.log"  # type: ignore[attr-defined]
    log.close()
    return process


def log_text(process: subprocess.Popen) -> str:
    return Path(process.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def stop(process: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM (clean leave), then SIGKILL if it hangs; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_supernet(path)[0].state_dict()


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def simulated_weights(config: SimulationConfig, out: Path) -> dict[str, torch.Tensor]:
    Simulation(config, out).run()
    return weights(out / "checkpoint.safetensors")


def server_config(config: SimulationConfig, out: Path, partition: Path, federation: str, **changes: object) -> ServerConfig:
    """The server settings that reproduce ``config``'s simulation."""
    settings = dict(
        out=str(out), preset=config.preset, rounds=config.rounds, per_round=config.per_round, min_clients=config.per_round,
        start_clients=config.clients, round_timeout=120.0, seed=config.seed, lr=config.lr, batch_size=config.batch_size,
        method=config.variants, augment=config.augment, eval_every=1, data=str(partition), federation=federation, wait_timeout=180.0,
    )
    settings.update(changes)
    return ServerConfig(**settings)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the federation under test


@pytest.fixture(scope="module")
def partition(tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("partition")
    write_partition(CONFIG, out)
    return out


@pytest.fixture(scope="module")
def simulation(tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> dict[str, torch.Tensor]:
    return simulated_weights(CONFIG, tmp_path_factory.mktemp("simulation"))


@pytest.fixture(scope="module")
def federated(tmp_path_factory: pytest.TempPathFactory, partition: Path) -> Iterator[dict]:
    """Server thread + 3 agent processes, 2 rounds; yields what the tests inspect, then stops everything."""
    assert port_open(1883), "no MQTT broker at 127.0.0.1:1883: start it with 'mosquitto -d -c /etc/mosquitto/mosquitto.conf'"
    fed = new_federation()
    out = tmp_path_factory.mktemp("federation")
    server = ServerThread(server_config(CONFIG, out, partition, fed)).start()
    agents = {}
    try:
        for entry in read_index(partition)["clients"]:
            cid = entry["client_id"]
            agents[cid] = spawn_agent(out / "logs", cid, partition / entry["file"], fed, "--model-dir", str(out / "received"))
        history = server.join(timeout=300)
        yield {"out": out, "history": history, "server": server, "agents": agents, "federation": fed}
    finally:
        codes = {cid: stop(p) for cid, p in agents.items()}
        server.close()
        clear_retained(fed)
    assert all(code == 0 for code in codes.values()), f"agents did not leave cleanly on SIGTERM: {codes}"


def test_final_global_weights_equal_the_simulation(federated: dict, simulation: dict[str, torch.Tensor]) -> None:
    got = weights(federated["out"] / CHECKPOINT)
    diff = max_abs_diff(got, simulation)
    assert diff <= 1e-6, f"MQTT federation and simulation differ by {diff}"
    assert all(torch.equal(got[k], simulation[k]) for k in got), f"equal within {diff}, but not bit-exact"


def test_rounds_use_the_simulators_cohorts_and_every_update(federated: dict, tmp_path: Path) -> None:
    sim = Simulation(CONFIG, tmp_path)
    history = federated["history"]
    assert [h.round for h in history] == [0, 1]
    for t, h in enumerate(history):
        assert h.cohort == sim.run_round(t).cohort
        assert h.updated == h.cohort and h.applied and not h.rejected and not h.missing
        assert h.val_accuracy is not None and 0 <= h.val_accuracy <= 1
    fields = read_record(federated["out"] / CHECKPOINT)["fields"]
    assert fields["round"] == 2 and fields["seed"] == CONFIG.seed and len(fields["registry"]) == 3


def test_registry_holds_every_device_with_its_budget_and_samples(federated: dict, partition: Path) -> None:
    registry = Registry(federated["out"] / "devices.sqlite")
    devices = {d.device_id: d for d in registry.devices()}
    registry.close()
    for entry in read_index(partition)["clients"]:
        d = devices[entry["client_id"]]
        assert d.budget_macs == int(entry["budget_macs"]) and d.samples == entry["samples"]
        assert d.first_seen <= d.last_seen and d.instance and d.host == entry["client_id"]
    assert sum(d.rounds for d in devices.values()) == sum(len(h.updated) for h in federated["history"])


def test_export_announces_each_device_its_model_and_fetch_model_verifies_it(federated: dict, tmp_path: Path) -> None:
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
        assert wait_for(lambda: all((received / f"{d}.onnx").is_file() for d in federated["agents"]), timeout=60), "agents did not save their pushed models"
        for m in manifests:
            assert hashlib.sha256((received / m["file"]).read_bytes()).hexdigest() == m["sha256"]
        target = manifests[-1]["device"]
        result = subprocess.run(
            [sys.executable, "-m", "feast_edge.agent.cli", "fetch-model", "--broker", LOCAL, "--device-id", target, "--out", str(tmp_path / "m.onnx"),
             "--federation", federated["federation"], "--timeout", "30", "--repeats", "10"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
    finally:
        server.stop.set()
        served.join(30)
        server.stop.clear()
    assert result.returncode == 0, result.stderr
    assert "verified" in result.stdout and "onnxruntime latency" in result.stdout
    assert hashlib.sha256((tmp_path / "m.onnx").read_bytes()).hexdigest() == manifests[-1]["sha256"]
    assert json.loads((tmp_path / "m.json").read_text())["device"] == target
