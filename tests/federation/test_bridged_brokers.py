"""Federations across bridged brokers (issue 12): the server on one Mosquitto, the agents on a second one bridged to it.

Both brokers are started here on free loopback ports, the agents' broker with a Mosquitto bridge to the
server's. Through a bridge that forwards the federation's topics both ways the federation ends with the
simulator's weights, bit for bit; through one that forwards only the devices' messages the server says
which devices registered but never receive.
"""

from __future__ import annotations

import getpass
from collections.abc import Iterator
from pathlib import Path

import pytest
from ports import free_port

from feast_edge.run.loop import CHECKPOINT
from feast_edge.server.brokers import Broker, start_mosquitto
from feast_edge.sim.shards import read_index

# Two private mosquittos bridged, a server thread, real agent processes.
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(600)]


def _broker(workdir: Path, name: str, bridge_to: int | None = None, direction: str = "both") -> Broker:
    port = free_port()
    lines = [
        f"user {getpass.getuser()}",
        "persistence false",
        "log_dest stderr",
        f"listener {port} 127.0.0.1",
        "allow_anonymous true",
    ]
    if bridge_to is not None:
        # The agents' site: one bridge connection to the server's broker carrying the federation's topics.
        lines += [
            f"connection {name}-to-server",
            f"address 127.0.0.1:{bridge_to}",
            "cleansession true",
            "try_private true",
            "restart_timeout 1 2",
            f"topic feast/# {direction} 1",
        ]
    config = workdir / f"{name}.conf"
    config.write_text("\n".join(lines) + "\n")
    return start_mosquitto(
        config, port, workdir / f"{name}.log", url=f"mqtt://127.0.0.1:{port}", enforces="nothing (test broker)"
    )


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[tuple[Broker, Path]]:
    server_site = _broker(tmp_path, "server-site")
    try:
        yield server_site, tmp_path
    finally:
        server_site.stop()


def _port(broker: Broker) -> int:
    return int(broker.url.rsplit(":", 1)[1])


def test_a_federation_across_a_bridge_ends_with_the_simulators_weights(
    kit, sites, partition: Path, tmp_path: Path
) -> None:
    server_site, workdir = sites
    device_site = _broker(workdir, "device-site", bridge_to=_port(server_site))
    fed = kit.new_federation()
    out = tmp_path / "federation"
    agents = []
    try:
        server = kit.ServerThread(kit.server_config(kit.CONFIG, out, partition, fed), broker=server_site.url).start()
        try:
            for entry in read_index(partition)["clients"]:
                agents.append(
                    kit.spawn_agent(
                        out / "logs", entry["client_id"], partition / entry["file"], fed, broker=device_site.url
                    )
                )
            history = server.join(timeout=300)
        finally:
            codes = [kit.stop(p) for p in agents]
            server.close()
    finally:
        device_site.stop()
    assert all(code == 0 for code in codes), codes
    assert [h.updated == h.cohort and h.applied for h in history] == [True, True]
    simulated = kit.simulated_weights(kit.CONFIG, tmp_path / "simulation")
    got = kit.weights(out / CHECKPOINT)
    assert all(k in simulated and (got[k] == simulated[k]).all() for k in got), (
        f"differs by {kit.max_abs_diff(got, simulated)}"
    )


def test_a_bridge_that_drops_the_downlinks_is_named_by_the_server(
    kit, sites, partition: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server_site, workdir = sites
    device_site = _broker(workdir, "one-way", bridge_to=_port(server_site), direction="out")  # devices -> server only
    fed = kit.new_federation()
    out = tmp_path / "federation"
    entry = read_index(partition)["clients"][0]
    agent = None
    caplog.set_level("WARNING", logger="feast_edge.server")
    server = kit.ServerThread(
        kit.server_config(kit.CONFIG, out, partition, fed, wait_timeout=30.0), broker=server_site.url
    ).start()
    try:
        agent = kit.spawn_agent(
            out / "logs",
            entry["client_id"],
            partition / entry["file"],
            fed,
            "--register-timeout",
            "25",
            broker=device_site.url,
        )
        warned = kit.wait_for(
            lambda: any("registered but never receives" in r.getMessage() for r in caplog.records), timeout=40
        )
        assert warned, "the server never said that the device does not receive"
        agent.wait(60)
        assert agent.returncode != 0 and "no feast-server answered the registration" in kit.log_text(agent)
    finally:
        if agent is not None:
            kit.stop(agent)
        server.close()
        device_site.stop()
    message = next(r.getMessage() for r in caplog.records if "registered but never receives" in r.getMessage())
    assert entry["client_id"] in message and f"feast/{fed}/ctrl/{entry['client_id']}" in message and "bridge" in message
