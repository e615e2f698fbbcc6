"""Fixtures of the federation tests: a real broker at 127.0.0.1:1883, server threads, real agent processes.

``kit`` bundles the helpers (run a server in a thread, spawn a real
``feast-agent`` process, compare weights, wait for a condition, the shared
small simulation config); ``federation`` is a fresh federation id whose
retained messages are cleared afterwards.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from ports import free_port

from commands import LOCAL, agent_command, command_options, reproducing, server_command, spawn
from feast_edge.run.checkpoint import load_supernet
from feast_edge.server.app import FederationServer, RoundRecord, ServerConfig
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.shards import write_partition
from feast_edge.sim.simulate import Simulation
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.retained import clear_retained as transport_clear_retained
from simconfigs import tiny_config

REPO = Path(__file__).resolve().parents[2]
# The federation tests' population: Fashion-MNIST on the fmnist-tiny test preset (tests/presets), a few dozen
# images per device; the real-size guards (one end-to-end test per path) set preset="fmnist-small" themselves.
CONFIG = tiny_config(clients=3, train_limit=300, test_limit=50, probe_variants=3, seed=3)


# --------------------------------------------------------------------------- shared helpers


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


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
    transport_clear_retained(LinkConfig(broker=broker), f"feast/{federation}/#")


class ServerThread:
    """A FederationServer running its rounds in a background thread of the test process."""

    def __init__(
        self, config: ServerConfig, broker: str = LOCAL, export: bool = False, link: LinkConfig | None = None
    ) -> None:
        self.server = FederationServer(config, link or LinkConfig(broker=broker))
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

    def start(self) -> ServerThread:
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


def spawn_agent(
    logs: Path, device_id: str, data: Path | str, federation: str, *extra: str, broker: str = LOCAL
) -> subprocess.Popen:
    """A real ``feast-agent run`` process, logging to ``logs/agent-<id>.log``."""
    return spawn(agent_command(device_id, data, federation, *extra, broker=broker), logs / f"agent-{device_id}.log")


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


def server_config(
    config: SimulationConfig, out: Path, partition: Path, federation: str, **changes: object
) -> ServerConfig:
    """The server settings that reproduce ``config``'s simulation."""
    settings = dict(
        reproducing(config),
        out=str(out),
        lr=config.training.lr,
        variants=config.training.variants,
        augment=config.training.augment,
        data=str(partition),
        federation=federation,
        server_opt=config.aggregation.server_opt,  # the simulation's (feast-server run's default may differ)
        server_lr=config.aggregation.server_lr,
        server_momentum=config.aggregation.server_momentum,
        server_betas=config.aggregation.server_betas,
        server_tau=config.aggregation.server_tau,
    )
    settings.update(changes)
    return ServerConfig.of(**settings)  # type: ignore[arg-type]


def own_data_federation(
    server: FederationServer, start_agents: Callable[[], dict[str, subprocess.Popen]], timeout: float = 400
) -> dict:
    """A server without data (started here) through its rounds, export and the devices' model reports, as
    ``feast-server run`` does, with the agents ``start_agents()`` spawns; every agent must exit 0. Returns the run's
    ``history``, ``manifests``, ``reports`` and ``registry``; the agents and the server are stopped whatever happens."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["history"] = server.run()
            manifests = outcome["manifests"] = server.export()
            served = server.announce_models(manifests)
            outcome["reports"] = server.await_device_models(manifests, served, timeout=120)
            if server.live is not None:
                server.live.models(manifests, Path(server.config.out) / "models", outcome["reports"])
            outcome["registry"] = {d.device_id: d for d in server.registry.devices()}
            server.finish(manifests)
            server.serve(2.0)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc

    server.start(timeout=5)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents = start_agents()
        thread.join(timeout)
        assert not thread.is_alive(), f"the federation did not finish in {timeout:g} s"
        if "error" in outcome:
            raise outcome["error"]
        for process in agents.values():
            assert process.wait(60) == 0, log_text(process)[-3000:]
    finally:
        for process in agents.values():
            stop(process)
        server.stop.set()
        server.close()
    outcome["agents"] = agents
    return outcome


class Kit:
    """The federation tests' shared helpers and settings, handed to tests as the ``kit`` fixture."""

    REPO = REPO
    LOCAL = LOCAL
    CONFIG = CONFIG
    ServerThread = ServerThread
    port_open = staticmethod(port_open)
    free_port = staticmethod(free_port)
    wait_for = staticmethod(wait_for)
    new_federation = staticmethod(new_federation)
    clear_retained = staticmethod(clear_retained)
    spawn_agent = staticmethod(spawn_agent)
    spawn = staticmethod(spawn)
    command_options = staticmethod(command_options)
    server_command = staticmethod(server_command)
    agent_command = staticmethod(agent_command)
    log_text = staticmethod(log_text)
    stop = staticmethod(stop)
    weights = staticmethod(weights)
    max_abs_diff = staticmethod(max_abs_diff)
    simulated_weights = staticmethod(simulated_weights)
    server_config = staticmethod(server_config)
    own_data_federation = staticmethod(own_data_federation)


@pytest.fixture(scope="session")
def kit() -> Kit:
    return Kit()


@pytest.fixture(scope="session")
def partition(kit: Kit, tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    """kit.CONFIG's population written as shard files (read-only for the tests), with the server's held-out split."""
    out = tmp_path_factory.mktemp("partition")
    write_partition(kit.CONFIG, out)
    return out


@pytest.fixture
def federation() -> Iterator[str]:
    assert port_open(1883), (
        "no MQTT broker at 127.0.0.1:1883: start it with 'mosquitto -d -c /etc/mosquitto/mosquitto.conf' ('make broker' does)"
    )
    fed = new_federation()
    yield fed
    clear_retained(fed)
