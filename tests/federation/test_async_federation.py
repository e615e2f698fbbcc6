"""Buffered asynchronous rounds over MQTT (feast-server run --mode async; feast_edge.server.jobs), against a real
Mosquitto: devices scripted with the transport itself send exactly the deltas the test chooses, from the versions
they were sent, late, forged, replayed or not at all."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from slowagents import agents_running, slow_down
from test_federation_failures import PRESET, ScriptedDevice, scripted_server, shifted

from feast_edge.agent.agent import Agent, AgentConfig
from feast_edge.agent.local_data import load_clients
from feast_edge.server.app import FederationServer, ServerConfig
from feast_edge.server.status import asynchronous_line, read_status
from feast_edge.settings.buffered import SERVER_LR, discount
from feast_edge.sim.shards import read_index, read_shard
from feast_edge.space.supernet import Supernet
from feast_edge.transport.broker import LinkConfig

pytestmark = [pytest.mark.broker]

PARAMETERS = {name for name, _ in Supernet(PRESET, seed=0).named_parameters()}


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k in PARAMETERS}


def _leading(full: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: full[k][tuple(slice(0, d) for d in v.shape)] for k, v in like.items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _async_server(kit, tmp_path: Path, federation: str, **changes: object):
    settings = dict(mode="async", buffer=2, concurrency=3, max_staleness=5, per_round=3, min_clients=3)
    return scripted_server(kit, tmp_path, federation, 2, start_clients=3, eval_every=2, **{**settings, **changes})


def _first_release(devices: dict[str, ScriptedDevice]) -> tuple[dict, dict]:
    """Every device registers and is sent version 0; a and b answer it (release 1) and are sent version 1."""
    for device in devices.values():
        assert device.register(samples=50).accepted
    sent = {name: device.next_round() for name, device in devices.items()}
    assert {start.round for start, _, _ in sent.values()} == {0}
    for name, delta in (("a", 0.5), ("b", 1.5)):
        start, manifest, state = sent[name]
        devices[name].send(*devices[name].update(start, shifted(state, delta), manifest))
    again = {name: devices[name].next_round() for name in ("a", "b")}
    assert {start.round for start, _, _ in again.values()} == {1}
    return sent, again


def test_a_late_device_is_rebased_and_discounted_while_the_others_release_and_forged_or_replayed_answers_are_ignored(
    kit, tmp_path: Path, federation: str
) -> None:
    server = _async_server(kit, tmp_path, federation)
    devices = {name: ScriptedDevice(federation, name) for name in ("a", "b", "slow")}
    try:
        sent, again = _first_release(devices)  # release 1 is out without waiting for slow
        theta0, theta1 = _params(sent["a"][2]), _params(again["a"][2])
        assert _close(theta1, {k: v + SERVER_LR * (0.5 + 1.5) / 2 for k, v in theta0.items()}) < 1e-5
        devices["b"].close()  # b goes away with its job of version 1: only that update is lost
        assert kit.wait_for(lambda: "b" not in server.server.online_devices(), timeout=10)
        start, manifest, state = sent["slow"]
        forged, blob = devices["slow"].update(start, shifted(state, 9.0), manifest, round=1)  # not the version it had
        devices["slow"].send(forged, blob)
        devices["slow"].send(*devices["slow"].update(start, shifted(state, 2.0), manifest))  # version 0, one late
        start, manifest, state = sent["a"]
        devices["a"].send(*devices["a"].update(start, shifted(state, 7.0), manifest))  # its answer to version 0 again
        start, manifest, state = again["a"]
        devices["a"].send(*devices["a"].update(start, shifted(state, -1.0), manifest))
        history = server.join(60)
    finally:
        for device in devices.values():
            device.close()
        server.close()
    first, second = history
    assert first.cohort == ["a", "b"] and first.staleness == {"a": 0, "b": 0} and first.applied
    assert second.cohort == ["a", "slow"] and second.staleness == {"a": 0, "slow": 1} and second.applied
    assert second.dropped == ["b"] and not second.rejected and not second.missing
    assert len(second.ignored) == 2, second.ignored  # the forged version and the replay
    assert second.clock > first.clock and set(second.durations) == {"a", "slow"}  # each job timed, send to arrival
    # θ2[u] = θ1[u] + η (1·(-1) + s(1)·2) / (1 + s(1)): slow's change, rebased on θ1, weighs 1/sqrt(2).
    s = discount("sqrt", 1)
    assert s == pytest.approx(1 / math.sqrt(2))
    theta2 = _leading(kit.weights(tmp_path / "checkpoint.safetensors"), theta1)
    expected = {k: v + SERVER_LR * (-1.0 + s * 2.0) / (1 + s) for k, v in theta1.items()}
    assert _close(theta2, expected) < 1e-5
    # feast-server status: each device's released updates and last staleness; the run over, nothing in flight.
    state = read_status(tmp_path)["asynchronous"]
    assert state["devices"] == {
        "a": {"released": 2, "staleness": 0},
        "b": {"released": 1, "staleness": 0},
        "slow": {"released": 1, "staleness": 1},
    }
    assert state["in_flight"] == {} and state["held"] == 0 and (state["buffer"], state["concurrency"]) == (2, 3)
    assert "buffer 0/2; in flight: none; refused as stale: 0" in asynchronous_line(state)


def test_an_update_staler_than_the_bound_is_refused_with_the_reason_and_its_device_sent_the_current_version(
    kit, tmp_path: Path, federation: str
) -> None:
    server = _async_server(kit, tmp_path, federation, max_staleness=0)
    devices = {name: ScriptedDevice(federation, name) for name in ("a", "b", "slow")}
    try:
        sent, again = _first_release(devices)
        start, manifest, state = sent["slow"]
        devices["slow"].send(*devices["slow"].update(start, shifted(state, 2.0), manifest))
        fresh = devices["slow"].next_round()  # refused, and drawn again at once: version 1
        assert fresh[0].round == 1
        for name, (start, manifest, state) in (("slow", fresh), ("a", again["a"])):
            devices[name].send(*devices[name].update(start, shifted(state, 0.25), manifest))
        history = server.join(60)
    finally:
        for device in devices.values():
            device.close()
        server.close()
    second = history[1]
    assert second.rejected == {"slow": "stale: trained from release 0 of 1, 1 behind (--max-staleness 0)"}
    assert second.cohort == ["a", "slow"] and second.staleness == {"a": 0, "slow": 0}


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_real_agents_keep_releasing_while_a_five_times_slower_one_trains_and_none_of_its_updates_is_lost(
    kit, tmp_path: Path, partition: Path, federation: str
) -> None:
    names = [f"client-{i:03d}" for i in range(3)]
    slow = names[-1]
    config = kit.server_config(
        kit.CONFIG, tmp_path / "run", partition, federation, mode="async", buffer=2, concurrency=3, rounds=8,
        max_staleness=20, eval_every=4,
    )  # fmt: skip
    budget = max(read_shard(partition / f"{name}.safetensors").budget_macs for name in names)  # alike but for speed
    agents = [
        Agent(
            AgentConfig(
                host=n, federation=federation, preset=kit.CONFIG.preset, threads=1, amp="off", budget_macs=budget
            ),
            LinkConfig(broker=kit.LOCAL),
            load_clients(partition / f"{n}.safetensors", n),
        )
        for n in names
    ]
    slow_down(agents[-1], 5.0)
    server = kit.ServerThread(config).start()
    try:
        with agents_running(agents):
            history = server.join(300)
    finally:
        server.close()
    assert len(history) == 8 and all(h.applied for h in history)
    released = {n: sum(n in h.cohort for h in history) for n in names}
    slow_taus = [h.staleness[slow] for h in history if slow in h.staleness]
    # Releases went on while the slow device trained: its updates arrive several releases late, and count.
    assert slow_taus and max(slow_taus) >= 2, slow_taus
    assert min(released[n] for n in names[:-1]) > released[slow], released
    for h in history:
        assert slow not in {*h.rejected, *h.incomplete, *h.missing, *h.dropped, *h.declined}, h
    # Every job it finished before the run ended was released; at most the one in flight at the end is abandoned.
    trained = agents[-1].rounds_trained
    assert released[slow] >= trained - 1, (released[slow], trained)


def test_a_resumed_run_drops_the_buffer_and_the_jobs_in_flight_and_refills_every_slot_from_its_last_release(
    kit, tmp_path: Path, federation: str
) -> None:
    settings = dict(mode="async", buffer=2, concurrency=3, max_staleness=5, per_round=3, min_clients=3)
    server = scripted_server(kit, tmp_path, federation, 3, start_clients=3, eval_every=3, **settings)
    devices = {name: ScriptedDevice(federation, name) for name in ("a", "b", "slow")}
    try:
        sent, again = _first_release(devices)
        start, manifest, state = again["a"]
        devices["a"].send(*devices["a"].update(start, shifted(state, 0.5), manifest))  # buffered: 1 of 2
        held = lambda: (read_status(tmp_path)["asynchronous"] or {}).get("held") == 1  # noqa: E731
        assert kit.wait_for(held, timeout=20)
        # feast-server status while it runs: the buffer, and who trains from which version.
        state = read_status(tmp_path)["asynchronous"]
        assert {d: j["version"] for d, j in state["in_flight"].items()} == {"b": 1, "slow": 0}
        server.close()  # stopped mid-buffer, after release 1
        assert server.error is not None  # the run did not finish
        server = scripted_server(kit, tmp_path, federation, 3, start_clients=3, eval_every=3, **settings)
        for device in devices.values():  # as an agent does when the server comes back
            assert device.register(samples=50).accepted
        # The old jobs' answers name transfers this server never sent: ignored. Every slot is refilled at version 1.
        fresh = {name: device.next_round() for name, device in devices.items()}
        assert {start.round for start, _, _ in fresh.values()} == {1}
        start, manifest, state = sent["slow"]
        devices["slow"].send(*devices["slow"].update(start, shifted(state, 2.0), manifest))
        for name in ("a", "b"):
            start, manifest, state = fresh[name]
            devices[name].send(*devices[name].update(start, shifted(state, 0.25), manifest))
        last = {name: devices[name].next_round() for name in ("a", "b")}
        for name in ("a", "b"):
            start, manifest, state = last[name]
            devices[name].send(*devices[name].update(start, shifted(state, 0.25), manifest))
        history = server.join(60)
    finally:
        for device in devices.values():
            device.close()
        server.close()
    assert [h.round for h in history] == [1, 2, 3]
    assert history[1].cohort == ["a", "b"] and history[1].staleness == {"a": 0, "b": 0}
    assert history[2].clock > history[1].clock > history[0].clock  # the clock goes on from the last release
    assert any("slow" in what for what in history[1].ignored), history[1].ignored


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_feast_server_run_mode_async_with_real_agent_processes_serves_every_device_and_status_shows_the_jobs(
    kit, tmp_path: Path, federation: str, partition: Path, server_cli
) -> None:
    clients = read_index(partition)["clients"]
    out, log = tmp_path / "run", tmp_path / "server.log"
    command = kit.server_command(
        kit.CONFIG.changed(rounds=4), out, federation, partition,
        mode="async", buffer=2, concurrency=3, max_staleness=8, wait_timeout=120,
    )  # fmt: skip
    with open(log, "w") as sink:
        server = subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, text=True)
    agents = [
        kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation, "--model-dir", str(tmp_path / "m"))
        for c in clients
    ]
    try:
        assert server.wait(300) == 0, log.read_text()[-4000:]
        assert all(agent.wait(120) == 0 for agent in agents), [kit.log_text(a)[-2000:] for a in agents]
    finally:
        for process in (*agents, server):
            kit.stop(process)
    text = log.read_text()
    assert re.search(r"release 4/4  replies (\d)/\1  staleness client-\d+ \d+, client-\d+ \d+.*  aggregated", text), (
        text
    )
    assert not re.search(r"^\d\d:\d\d:\d\d (error|critical):|ERROR|Traceback", text, flags=re.M), text
    assert {p.name for p in (tmp_path / "m").glob("*.onnx")} == {f"{c['client_id']}.onnx" for c in clients}
    status = server_cli.invoke("status", "--out", str(out))
    assert status.returncode == 0 and "asynchronous: 2 updates per release, 3 devices training at once" in status.stdout


def test_federated_validation_between_asynchronous_releases_is_refused_with_the_fix(tmp_path: Path, server_cli) -> None:
    result = server_cli.invoke(
        "run",
        "--out",
        str(tmp_path / "run"),
        "--mode",
        "async",
        "--rounds",
        "10",
        "--eval-every",
        "2",
        "--insecure",
        "--broker",
        "mqtt://127.0.0.1:1883",
    )
    server_cli.assert_user_error(result, "give --data to validate on the server, or --eval-every 10")


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_without_server_data_an_asynchronous_run_validates_calibrates_and_serves_on_the_devices_after_its_last_release(
    kit, tmp_path: Path, federation: str, partition: Path
) -> None:
    clients = read_index(partition)["clients"]
    config = ServerConfig.of(
        out=str(tmp_path / "run"), federation=federation, preset=kit.CONFIG.preset, rounds=3, mode="async", buffer=2,
        concurrency=3, eval_every=3, per_round=3, min_clients=3, start_clients=3, round_timeout=120.0,
        wait_timeout=120.0, batch_size=32, calib_samples=50,
    )  # fmt: skip
    server = FederationServer(config, LinkConfig(broker=kit.LOCAL))

    def start_agents() -> dict:
        return {
            c["client_id"]: kit.spawn_agent(
                tmp_path / "logs",
                c["client_id"],
                partition / c["file"],
                federation,
                "--holdout",
                "0.2",
                "--model-dir",
                str(tmp_path / "models"),
            )  # fmt: skip
            for c in clients
        }

    (tmp_path / "logs").mkdir()
    outcome = kit.own_data_federation(server, start_agents)
    history = outcome["history"]
    assert [h.round for h in history] == [1, 2, 3] and all(h.staleness for h in history)
    assert history[-1].val_accuracy is not None and history[-1].validation["source"] == "devices"
    assert {m["device"] for m in outcome["manifests"]} == {c["client_id"] for c in clients}
    assert all(m["calibration"] == "federated" for m in outcome["manifests"])
    assert set(outcome["reports"]) == {c["client_id"] for c in clients}
