"""``feast-agent models`` and ``feast-agent rollback`` (feast_edge.agent.versions_cli): what a device holds, going back one
version, and telling the server over the real broker at 127.0.0.1:1883 (a raw paho client reads what arrives)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from ports import free_port
from versionfiles import receive

from feast_edge.agent.version_store import VersionStore
from feast_edge.protocol import VersionReport
from feast_edge.transport.messages import parse
from feast_edge.transport.topics import Topics

BROKER = "mqtt://127.0.0.1:1883"


def _held(model_dir: Path) -> None:
    """jetson: versions 1 and 2 installed, 3 refused; pi: one version."""
    jetson = VersionStore(model_dir, "jetson")
    receive(jetson, b"model 1", 1, holdout_accuracy=0.5, holdout_examples=40, test_accuracy=0.45, test_examples=20)
    receive(jetson, b"model 2", 2, holdout_accuracy=0.625, holdout_examples=40)
    receive(jetson, b"model 3", 3, install=False, holdout_accuracy=0.1, holdout_examples=40)
    receive(VersionStore(model_dir, "pi"), b"pi model", 4)


class Subscriber:
    """A raw paho client on one events topic of the shared broker: every payload it receives, parsed."""

    def __init__(self, topic: str) -> None:
        self.messages: list[object] = []
        self.ready = threading.Event()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{time.monotonic_ns()}")
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, qos=1)
        self.client.on_subscribe = lambda *args: self.ready.set()
        self.client.on_message = lambda c, u, m: self.messages.append(parse(m.payload))
        self.client.connect("127.0.0.1", 1883, 10)
        self.client.loop_start()
        assert self.ready.wait(5), "the raw client could not subscribe"

    def first(self, timeout: float = 10.0) -> VersionReport:
        deadline = time.monotonic() + timeout
        while not self.messages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.messages) == 1, self.messages
        return self.messages[0]  # type: ignore[return-value]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_models_lists_what_each_device_holds_newest_first(tmp_path, agent_cli) -> None:
    _held(tmp_path)
    table = agent_cli.invoke("models", "--model-dir", str(tmp_path))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == (
        "jetson: runs version 2 (round 7, seq 0002); rollback goes back to version 1 (round 7, seq 0001)"
    )
    rows = [line.split() for line in lines if line.strip()[:4].isdigit()]
    assert [(r[0], r[1], r[3]) for r in rows[:3]] == [("0003", "3", "refused"), ("0002", "2", "installed"),
                                                      ("0001", "1", "installed")]  # fmt: skip
    assert rows[0][-1] == "deleted" and rows[1][-1] == "current" and rows[2][-2:] == ["kept", "(rollback)"]
    assert "62.5% of 40" in lines[3] and "50.0% of 40" in lines[4] and "45.0% of 20" in lines[4]
    assert any(line.startswith("pi: runs version 4") for line in lines)

    one = agent_cli.invoke("models", "--model-dir", str(tmp_path), "--device-id", "jetson", "--json")
    assert one.returncode == 0, one.stderr
    view = json.loads(one.stdout)["devices"]
    assert [d["device"] for d in view] == ["jetson"] and (view[0]["current"], view[0]["previous"]) == (2, 1)
    first = view[0]["versions"][-1]
    assert (first["version"], first["test_accuracy"], first["previous"], first["current"]) == (1, 0.45, True, False)
    assert view[0]["in_place"] is True and view[0]["versions"][0]["decision"] == "refused"


def test_rollback_makes_the_previous_version_current_and_tells_the_server(tmp_path, agent_cli, federation) -> None:
    _held(tmp_path)
    heard = Subscriber(Topics(federation).events("jetson"))
    try:
        result = agent_cli.invoke(
            "rollback", "--model-dir", str(tmp_path), "--device-id", "jetson", "--broker", BROKER,
            "--federation", federation,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        report = heard.first()
    finally:
        heard.close()
    assert isinstance(report, VersionReport) and report.federation == federation and report.device == "jetson"
    assert (report.decision, report.version, report.running, report.examples) == ("rolled-back", 2, 1, 0)
    assert (tmp_path / "jetson.onnx").read_bytes() == b"model 1"
    assert "it runs version 1 (round 7, seq 0001) again (held-out 50.0% of 40); left version 2" in result.stdout
    assert f"told the server of federation {federation}: jetson left version 2, runs 1" in result.stdout
    held = VersionStore(tmp_path, "jetson").read()
    assert held.current == 1 and held.rollback.told and held.record(2).rolled_back is not None


def test_a_rollback_the_broker_did_not_hear_stands_and_is_told_later_with_tell_only(
    tmp_path, agent_cli, federation
) -> None:
    _held(tmp_path)
    nobody = f"mqtt://127.0.0.1:{free_port()}"
    result = agent_cli.invoke(
        "rollback",
        "--model-dir",
        str(tmp_path),
        "--device-id",
        "jetson",
        "--broker",
        nobody,
        "--federation",
        federation,
    )
    agent_cli.assert_user_error(result, "rolled back locally, but the server was not told (cannot reach MQTT broker")
    assert "feast-agent rollback --tell-only" in result.stderr and result.returncode == 2
    assert (tmp_path / "jetson.onnx").read_bytes() == b"model 1"  # the rollback stands
    listed = agent_cli.invoke("models", "--model-dir", str(tmp_path), "--device-id", "jetson")
    assert "the server has not heard of the rollback" in listed.stdout

    heard = Subscriber(Topics(federation).events("jetson"))
    try:
        told = agent_cli.invoke(
            "rollback", "--tell-only", "--model-dir", str(tmp_path), "--device-id", "jetson", "--broker", BROKER,
            "--federation", federation,
        )  # fmt: skip
        assert told.returncode == 0, told.stderr
        report = heard.first()
    finally:
        heard.close()
    assert (report.decision, report.version, report.running) == ("rolled-back", 2, 1)
    assert "rolled back" not in told.stdout.splitlines()[0]  # nothing rolled back again
    assert VersionStore(tmp_path, "jetson").read().current == 1

    # Without any broker option it rolls back and says the server was not told, and how to tell it.
    receive(VersionStore(tmp_path, "jetson"), b"model 4", 4)
    alone = agent_cli.invoke("rollback", "--model-dir", str(tmp_path), "--device-id", "jetson")
    agent_cli.assert_user_error(alone, "the server was not told (no --broker or --credentials given)")
    assert (tmp_path / "jetson.onnx").read_bytes() == b"model 1"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["models", "--model-dir", "{missing}"], "does not exist; give the folder 'feast-agent run --model-dir'"),
        (["models", "--model-dir", "{empty}"], "holds no model versions yet"),
        (["models", "--model-dir", "{dir}", "--device-id", "nano"], "holds no model versions of device 'nano'"),
        (["models", "--model-dir", "{dir}", "--device-id", "a/b"], "--device-id"),
        (["rollback", "--model-dir", "{dir}"], "give --device-id NAME"),
        (["rollback", "--model-dir", "{dir}", "--device-id", "pi"], "nothing to roll back to: pi runs version 4"),
        (["rollback", "--model-dir", "{dir}", "--device-id", "pi", "--tell-only"], "pi has not been rolled back"),
        (["rollback", "--model-dir", "{missing}", "--device-id", "pi"], "does not exist"),
    ],
)
def test_a_bad_request_is_one_error_line_with_the_fix(tmp_path, agent_cli, args, fragment) -> None:
    _held(tmp_path / "dir")
    (tmp_path / "empty").mkdir()
    places = {"dir": tmp_path / "dir", "empty": tmp_path / "empty", "missing": tmp_path / "missing"}
    result = agent_cli.invoke(*[a.format(**places) for a in args])
    agent_cli.assert_user_error(result, fragment)
    assert result.returncode == 2
    assert (tmp_path / "dir" / "pi.onnx").read_bytes() == b"pi model"  # nothing changed


@pytest.mark.slow
@pytest.mark.broker  # a private mosquitto with TLS and passwords, from feast-server provision
def test_a_rollback_with_credentials_is_signed_as_the_device(tmp_path, agent_cli) -> None:
    """With --credentials the report goes as fetch-model's request does: signed with the device's key, which the
    server's link verifies (an unsigned or forged one never reaches its handler)."""
    import getpass

    from feast_edge.server.brokers import start_mosquitto
    from feast_edge.server.provision import provision
    from feast_edge.transport.credentials import load_credentials
    from feast_edge.transport.link import Link

    port = free_port()
    done = provision(
        tmp_path / "pki", "lab", ["jet"], auth="password", hosts=("127.0.0.1",), port=port, bind="127.0.0.1",
        broker_user=getpass.getuser(),
    )  # fmt: skip
    broker = start_mosquitto(
        done.broker_config, port, tmp_path / "broker.log", url=f"mqtts://127.0.0.1:{port}", enforces=""
    )
    models = tmp_path / "models"
    store = VersionStore(models, "jet")
    receive(store, b"model 1", 1)
    receive(store, b"model 2", 2)
    heard: list[object] = []
    server = Link(load_credentials(done.server).link_config())
    server.subscribe(Topics("lab").events("jet"), lambda r: heard.append(parse(r.payload)))
    try:
        server.connect(timeout=10)
        result = agent_cli.invoke("rollback", "--credentials", str(done.devices["jet"]), "--model-dir", str(models))
        assert result.returncode == 0, result.stderr
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.close()
        broker.stop()
    assert len(heard) == 1 and isinstance(heard[0], VersionReport)
    assert (heard[0].device, heard[0].decision, heard[0].version, heard[0].running) == ("jet", "rolled-back", 2, 1)
