"""Restarts in every order, a broker outage and a crashed device, with real processes; each test ends with a checked outcome.

The server restart with agents that stay up is ``test_federation_failures.py``;
here everything stops at once (a power cut: SIGKILL) and comes back in either
order, the broker itself dies mid-run (a private mosquitto on a free loopback
port, never the shared one), and a device killed with SIGKILL comes back as a
new agent instance under the same id. Where the rounds and cohorts cannot
differ from an undisturbed run the final weights must equal the simulation's;
where a disturbance may cost updates they must equal a replay of the rounds the
server recorded (each aggregated update recomputed in this process).

Two tests pin down what a broker restart still breaks: an update published
before the server is back on the broker is lost for good, and a device that
died while the broker was down stays "online" to the server, which then
refuses the device's next agent.
"""

from __future__ import annotations

import getpass
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT, RoundRecord
from feast_edge.server.app import REGISTRY
from feast_edge.server.registry import Device, Registry
from feast_edge.sim.replay import replay_rounds
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.shards import read_index

# Real processes stopped, killed and restarted, a private mosquitto restarted; each test waits minutes at most.
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(600)]

ROUNDS = 3


@pytest.fixture(scope="module")
def expected(kit, tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of the undisturbed run: the simulation of the same config, ROUNDS rounds."""
    return kit.simulated_weights(kit.CONFIG.changed(rounds=ROUNDS), tmp_path_factory.mktemp("simulation"))


class PrivateBroker:
    """A mosquitto of this test alone on a free loopback port, killed and restarted on the same port."""

    def __init__(self, kit, directory: Path) -> None:
        self.kit, self.directory = kit, directory
        self.port = kit.free_port()
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.conf = directory / "mosquitto.conf"
        self.conf.write_text(
            f"user {getpass.getuser()}\npersistence false\nlog_dest stderr\nlistener {self.port} 127.0.0.1\nallow_anonymous true\n"
        )
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.directory / f"mosquitto-{self.starts}.log", "w") as log:
            self.process = subprocess.Popen(["mosquitto", "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        if not self.kit.wait_for(lambda: self.kit.port_open(self.port), timeout=10):
            pytest.fail(
                f"private mosquitto did not start on port {self.port}: {(self.directory / f'mosquitto-{self.starts}.log').read_text()}"
            )

    def kill(self) -> None:
        """SIGKILL: no will is published, every retained message is gone (no persistence)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)
        assert self.kit.wait_for(lambda: not self.kit.port_open(self.port), timeout=5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture
def private_broker(kit, tmp_path: Path) -> Iterator[PrivateBroker]:
    broker = PrivateBroker(kit, tmp_path)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def completed_rounds(checkpoint: Path) -> int:
    return read_record(checkpoint)["fields"]["round"] if checkpoint.is_file() else 0


def registered(out: Path) -> dict[str, Device]:
    """The devices the run's registry holds, by id."""
    registry = Registry(out / REGISTRY, readonly=True)
    try:
        return {d.device_id: d for d in registry.devices()}
    finally:
        registry.close()


def instances(out: Path) -> dict[str, str]:
    """Device id -> the agent instance the registry holds."""
    return {d: device.instance for d, device in registered(out).items()}


def budgets(out: Path) -> dict[str, float]:
    """Device id -> the MAC budget it registered (what the server planned with)."""
    return {d: float(device.budget_macs) for d, device in registered(out).items()}


def replayed_weights(
    records: list[RoundRecord], partition: Path, config: SimulationConfig, budget_of: dict[str, float]
) -> dict[str, torch.Tensor]:
    """The recorded rounds recomputed in process (``feast_edge.sim.replay``)."""
    return replay_rounds(records, partition, config, budget_of)


def no_refusal(*texts: str) -> None:
    for text in texts:
        assert "already online" not in text and "refused" not in text, text


# --------------------------------------------------------------------------- everything stops, then comes back in either order


@pytest.mark.parametrize("order", ["agents-first", "server-first"])
def test_a_full_stop_resumes_in_either_restart_order(
    kit, tmp_path: Path, federation: str, partition: Path, expected: dict, order: str
) -> None:
    """SIGKILL to the server and every agent mid-federation; whichever comes back first, the run resumes and ends as if undisturbed."""
    config = kit.CONFIG.changed(rounds=ROUNDS)
    out = tmp_path / "run"
    checkpoint = out / CHECKPOINT
    command = kit.server_command(config, out, federation, partition, no_export=True)
    clients = read_index(partition)["clients"]

    def agents(logs: Path) -> list[subprocess.Popen]:
        return [kit.spawn_agent(logs, c["client_id"], partition / c["file"], federation) for c in clients]

    first = kit.spawn(command, tmp_path / "server-first.log")
    before = agents(tmp_path / "before")
    after: list[subprocess.Popen] = []
    second = None
    try:
        assert kit.wait_for(lambda: completed_rounds(checkpoint) >= 1, timeout=240, interval=0.02), (
            tmp_path / "server-first.log"
        ).read_text()
        for process in [first, *before]:
            process.send_signal(signal.SIGKILL)
        for process in [first, *before]:
            process.wait(10)
        killed_at = completed_rounds(checkpoint)
        assert killed_at < ROUNDS, "the federation finished before it could be stopped"
        stale = instances(out)
        assert sorted(stale) == [c["client_id"] for c in clients]
        server_log = tmp_path / "server-second.log"
        if order == "agents-first":
            after = agents(tmp_path / "after")
            # Up, connected (retained presence online) and asking a server that is not there yet.
            assert kit.wait_for(lambda: all("connected to" in kit.log_text(a) for a in after), timeout=60)
        second = kit.spawn(command, server_log)
        if order == "server-first":
            assert kit.wait_for(lambda: "waiting for devices" in server_log.read_text(), timeout=60), (
                server_log.read_text()
            )
            after = agents(tmp_path / "after")
        second.wait(240)
        assert kit.wait_for(lambda: all(a.poll() is not None for a in after), timeout=60), (
            "agents did not leave after the last round"
        )
    finally:
        for process in [first, *before, *after] + ([second] if second else []):
            kit.stop(process)
    text = server_log.read_text()
    assert second.returncode == 0, text
    assert f"resuming from {checkpoint}: {killed_at} of {ROUNDS} rounds completed" in " ".join(text.split()), text
    no_refusal(text, *(kit.log_text(a) for a in after))
    assert [a.returncode for a in after] == [0, 0, 0], [kit.log_text(a) for a in after]
    # Each device's stale registration (the killed agent's instance) was replaced by the new agent's.
    fresh = instances(out)
    assert fresh.keys() == stale.keys() and all(fresh[d] != stale[d] for d in fresh), (stale, fresh)
    fields = read_record(checkpoint)["fields"]
    assert fields["round"] == ROUNDS and [h["round"] for h in fields["history"]] == list(range(1, ROUNDS + 1))
    diff = kit.max_abs_diff(kit.weights(checkpoint), expected)
    assert diff <= 1e-6, (
        f"the federation stopped and restarted {order} differs from the undisturbed simulation by {diff}"
    )


# --------------------------------------------------------------------------- the broker dies mid-run


def test_a_broker_restart_mid_run_lets_the_federation_finish(
    kit, tmp_path: Path, federation: str, partition: Path, private_broker: PrivateBroker
) -> None:
    """SIGKILL to the broker after round 1 (retained presences die with it), down 4 s, back on the same port: every round completes."""
    config = kit.CONFIG.changed(rounds=ROUNDS)
    out = tmp_path / "run"
    checkpoint = out / CHECKPOINT
    # A message lost in the outage costs its round the deadline: keep that short.
    command = kit.server_command(
        config, out, federation, partition, broker=private_broker.url, no_export=True, round_timeout=30
    )
    server_log = tmp_path / "server.log"
    server = kit.spawn(command, server_log)
    clients = read_index(partition)["clients"]
    agents = [
        kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation, broker=private_broker.url)
        for c in clients
    ]
    try:
        assert kit.wait_for(lambda: completed_rounds(checkpoint) >= 1, timeout=240, interval=0.02), (
            server_log.read_text()
        )
        private_broker.kill()
        killed_at = completed_rounds(checkpoint)
        assert killed_at < ROUNDS, "the federation finished before the broker could be killed"
        time.sleep(4.0)
        private_broker.start()
        server.wait(240)
        assert kit.wait_for(lambda: all(a.poll() is not None for a in agents), timeout=60), (
            "agents did not leave after the last round"
        )
    finally:
        codes = [kit.stop(a) for a in agents]
        kit.stop(server)
    text = server_log.read_text()
    assert server.returncode == 0, text
    history = [RoundRecord.from_dict(h) for h in read_record(checkpoint)["fields"]["history"]]
    assert [h.round for h in history] == list(range(1, ROUNDS + 1))
    assert codes == [0, 0, 0], [kit.log_text(a) for a in agents]
    assert all("reconnected to MQTT broker" in kit.log_text(a) for a in agents) and "reconnected to MQTT broker" in text
    for h in history:  # every cohort member is accounted for
        assert sorted(h.updated + list(h.rejected) + h.missing + h.dropped) == h.cohort, h
    diff = kit.max_abs_diff(kit.weights(checkpoint), replayed_weights(history, partition, config, budgets(out)))
    assert diff <= 1e-6, (
        f"the federation across the broker restart differs from a replay of its recorded rounds by {diff}"
    )


def test_an_update_sent_before_the_server_is_back_on_the_broker_still_counts(
    kit, tmp_path: Path, federation: str, private_broker: PrivateBroker
) -> None:
    """The broker dies while a device trains and the device reconnects before the server does: its update must not be lost.

    Which side reconnects first is up to paho's backoff (1, 2, 4 ... 30 s); the server is held (SIGSTOP) only to
    fix that order. The device publishes its update when the new broker has no subscriber for it yet.
    """
    out = tmp_path / "run"
    # fmnist-small (the default preset) on a real shard: the chaos tests' real-size guard; no --data: a server without data.
    command = kit.server_command(
        kit.CONFIG.changed(preset="fmnist-small", rounds=1, per_round=1), out, federation,
        broker=private_broker.url, round_timeout=60, wait_timeout=120, no_export=True, seed=None, batch_size=None,
        eval_every=None, start_clients=None,
    )  # fmt: skip
    server_log = tmp_path / "server.log"
    server = kit.spawn(command, server_log)
    # ~600 examples on the largest envelope: several seconds of training, long enough to take the broker away meanwhile.
    agent = kit.spawn_agent(
        tmp_path,
        "slow",
        FASHION_MNIST_DIR,
        federation,
        "--shard",
        "0/100",
        "--budget",
        "39M",
        broker=private_broker.url,
    )
    try:
        assert kit.wait_for(lambda: "slow trains" in kit.log_text(agent), timeout=120), kit.log_text(agent)
        server.send_signal(signal.SIGSTOP)
        private_broker.kill()
        time.sleep(1.0)
        private_broker.start()
        assert kit.wait_for(lambda: "slow sent its update" in kit.log_text(agent), timeout=60), kit.log_text(agent)
        server.send_signal(signal.SIGCONT)
        server.wait(120)
    finally:
        server.send_signal(signal.SIGCONT)
        code = kit.stop(agent)
        kit.stop(server)
    assert server.returncode == 0 and code == 0, server_log.read_text()
    record = RoundRecord.from_dict(read_record(out / CHECKPOINT)["fields"]["history"][0])
    assert record.updated == ["slow"] and record.applied, (
        f"the update the device sent after the broker restart never reached the server (missing: {record.missing}); "
        f"the round waited for its deadline instead:\n{server_log.read_text()}"
    )


def test_a_device_that_died_while_the_broker_was_down_can_come_back(
    kit, tmp_path: Path, federation: str, partition: Path, private_broker: PrivateBroker
) -> None:
    """An agent SIGKILLed during a broker outage leaves no last will (its broker is gone); once the broker is back its next instance must be accepted.

    The server still counts the dead agent's host as online (no offline status can ever come), so today the
    restarted agent is refused as "already online" until the server itself restarts, and the dead device stays
    in the cohort draws, each costing its round the whole --round-timeout.
    """
    out = tmp_path / "run"
    server = kit.ServerThread(
        kit.server_config(kit.CONFIG, out, partition, federation), broker=private_broker.url
    ).start()  # waits for 3 devices
    entry = read_index(partition)["clients"][0]
    device = entry["client_id"]
    first = kit.spawn_agent(
        tmp_path / "first", device, partition / entry["file"], federation, broker=private_broker.url
    )
    second = None
    try:
        assert kit.wait_for(lambda: device in server.server.online_devices(), timeout=120), kit.log_text(first)
        private_broker.kill()
        first.kill()  # dies while no broker holds its connection: no last will is ever published
        first.wait(10)
        private_broker.start()
        assert kit.wait_for(lambda: server.server.link.connected, timeout=60), (
            "the server did not reconnect to the restarted broker"
        )
        second = kit.spawn_agent(
            tmp_path / "second", device, partition / entry["file"], federation, broker=private_broker.url
        )
        assert kit.wait_for(
            lambda: f"registered {device} with federation" in kit.log_text(second) or second.poll() is not None,
            timeout=120,
        )
        text = kit.log_text(second)
    finally:
        for process in (first, second):
            if process is not None:
                kit.stop(process)
        server.close()
    assert f"registered {device} with federation" in text, (
        f"the restarted device was locked out after the broker restart:\n{text}"
    )


# --------------------------------------------------------------------------- a crashed device comes back


def test_a_device_killed_without_leaving_is_replaced_by_its_next_instance(
    kit, tmp_path: Path, federation: str, partition: Path, expected: dict
) -> None:
    """SIGKILL an agent after it registered: its last will frees the id, the restarted agent is accepted and the run ends as undisturbed."""
    out = tmp_path / "run"
    config = kit.CONFIG.changed(rounds=ROUNDS)
    server = kit.ServerThread(kit.server_config(config, out, partition, federation)).start()  # waits for all 3 devices
    clients = read_index(partition)["clients"]
    victim = clients[-1]
    vid = victim["client_id"]
    crashed = kit.spawn_agent(tmp_path / "crashed", vid, partition / victim["file"], federation)
    agents: list[subprocess.Popen] = []
    try:
        assert kit.wait_for(lambda: vid in server.server.online_devices(), timeout=120), kit.log_text(crashed)
        stale = instances(out)[vid]
        crashed.kill()  # no DISCONNECT, no offline status of its own: only the broker's last will says it is gone
        crashed.wait(10)
        assert kit.wait_for(lambda: vid not in server.server.online_devices(), timeout=10), (
            "the last will did not take the device offline"
        )
        agents.append(kit.spawn_agent(tmp_path / "restarted", vid, partition / victim["file"], federation))
        assert kit.wait_for(lambda: f"registered {vid} with federation" in kit.log_text(agents[0]), timeout=120), (
            kit.log_text(agents[0])
        )
        assert instances(out)[vid] != stale
        agents += [kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation) for c in clients[:-1]]
        history = server.join(timeout=180)
        server.server.finish([])  # what feast-server run does after the last round: the agents leave
        assert kit.wait_for(lambda: all(a.poll() is not None for a in agents), timeout=60), (
            "agents did not leave after the last round"
        )
    finally:
        codes = [kit.stop(a) for a in [crashed, *agents]]
        server.close()
    no_refusal(*(kit.log_text(a) for a in agents))
    assert codes[1:] == [0, 0, 0], [kit.log_text(a) for a in agents]
    assert all(h.updated == h.cohort and h.applied for h in history), history
    diff = kit.max_abs_diff(kit.weights(out / CHECKPOINT), expected)
    assert diff <= 1e-6, f"the federation with a replaced device differs from the undisturbed simulation by {diff}"
