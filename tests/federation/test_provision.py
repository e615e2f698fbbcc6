"""`feast-server provision` against real Mosquitto instances: TLS, client certificates or passwords, the ACL, signed messages.

Each broker here is started by the test from the configuration provision wrote,
on a free loopback port; the attackers are raw paho clients holding another
device's credentials, or none.
"""

from __future__ import annotations

import getpass
import json
import logging
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509
from paho.mqtt.enums import CallbackAPIVersion
from ports import free_port

from feast_edge.protocol import Register, Registered
from feast_edge.server.brokers import Broker, start_mosquitto
from feast_edge.server.provision import Provisioned, provision
from feast_edge.sim.shards import read_index
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.credentials import CredentialsError, load_credentials
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics

FED = "lab"
T = Topics(FED)


@dataclass
class ProvisionedBroker:
    done: Provisioned
    broker: Broker
    port: int
    auth: str

    def link(self, name: str) -> Link:
        bundle = self.done.server if name == "server" else self.done.devices[name]
        return Link(load_credentials(bundle).link_config())


def start_provisioned(root: Path, auth: str, devices: list[str], federation: str = FED) -> ProvisionedBroker:
    port = free_port()
    done = provision(
        root,
        federation,
        devices,
        auth=auth,
        hosts=("127.0.0.1",),
        port=port,
        bind="127.0.0.1",
        broker_user=getpass.getuser(),
    )
    broker = start_mosquitto(
        done.broker_config, port, root / "broker.log", url=f"mqtts://127.0.0.1:{port}", enforces=""
    )
    return ProvisionedBroker(done, broker, port, auth)


@pytest.fixture(scope="module", params=["certificate", "password"])
def provisioned(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProvisionedBroker]:
    running = start_provisioned(tmp_path_factory.mktemp(request.param), request.param, ["jet", "pi"])
    yield running
    running.broker.stop()


class Raw:
    """A raw paho client (the attacker's tool), connected with whatever credentials it is given."""

    def __init__(
        self,
        port: int,
        *,
        ca: str | None,
        cert: tuple[str, str] | None = None,
        user: tuple[str, str] | None = None,
        tls: bool = True,
    ) -> None:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"raw-{time.monotonic_ns()}")
        self.received: list[mqtt.MQTTMessage] = []
        self.connack: list[object] = []
        self.connected = threading.Event()
        self.client.on_message = lambda c, u, m: self.received.append(m)
        self.client.on_connect = lambda c, u, f, rc, p: (self.connack.append(rc), self.connected.set())
        if user is not None:
            self.client.username_pw_set(*user)
        if tls:
            context = ssl.create_default_context(cafile=ca)
            if cert is not None:
                context.load_cert_chain(*cert)
            self.client.tls_set_context(context)
        self.port = port

    def connect(self) -> bool:
        """True when the broker accepted the connection."""
        try:
            self.client.connect("127.0.0.1", self.port, 10)
        except (ssl.SSLError, OSError):
            return False
        self.client.loop_start()
        self.connected.wait(5)
        time.sleep(0.3)  # a refused TLS client certificate shows as the broker closing the connection
        return bool(self.connack) and not self.connack[0].is_failure and self.client.is_connected()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def raw_as(provisioned: ProvisionedBroker, name: str) -> Raw:
    bundle = load_credentials(provisioned.done.server if name == "server" else provisioned.done.devices[name])
    if bundle.auth == "certificate":
        raw = Raw(provisioned.port, ca=bundle.ca_file, cert=(bundle.cert_file, bundle.key_file))
    else:
        raw = Raw(provisioned.port, ca=bundle.ca_file, user=(bundle.username, bundle.password))
    assert raw.connect(), f"{name}'s own credentials were refused"
    return raw


# --------------------------------------------------------------------------- provisioning


def test_provision_writes_bundles_and_extends_without_changing_existing_keys(tmp_path: Path) -> None:
    first = provision(tmp_path, FED, ["jet", "pi"])
    jet = {f.name: f.read_bytes() for f in first.devices["jet"].iterdir()}
    ca = (tmp_path / "ca" / "ca.crt").read_bytes()
    second = provision(tmp_path, FED, ["orin"])
    assert second.added == ["orin"] and sorted(second.devices) == ["jet", "orin", "pi"]
    assert {f.name: f.read_bytes() for f in second.devices["jet"].iterdir()} == jet  # keys, certificate and bundle kept
    assert (tmp_path / "ca" / "ca.crt").read_bytes() == ca
    server = load_credentials(second.server)
    assert server.role == "server" and sorted(server.peers) == ["jet", "orin", "pi"]
    device = load_credentials(second.devices["orin"])
    assert device.identity == "orin" and device.federation == FED and list(device.peers) == ["server"]
    assert x509.load_pem_x509_certificate(Path(device.cert_file).read_bytes()).subject.rfc4514_string() == "CN=orin"
    for private in ("signing.key", "client.key", "bundle.json"):
        assert (second.devices["orin"] / private).stat().st_mode & 0o077 == 0, f"{private} is readable by others"
    serial = x509.load_pem_x509_certificate((first.devices["pi"] / "client.crt").read_bytes()).serial_number
    third = provision(tmp_path, FED, [], revoke=("pi",))
    assert sorted(third.devices) == ["jet", "orin"] and not (tmp_path / "devices" / "pi").exists()
    crl = x509.load_pem_x509_crl((tmp_path / "broker" / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(serial) is not None
    assert sorted(load_credentials(third.server).peers) == ["jet", "orin"]


def test_provision_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    from feast_edge.server.provision import ProvisionError

    provision(tmp_path, FED, ["jet"])
    with pytest.raises(ProvisionError, match="federation 'lab'"):
        provision(tmp_path, "other", ["pi"])
    with pytest.raises(ProvisionError, match="--auth certificate"):
        provision(tmp_path, FED, ["pi"], auth="password")
    with pytest.raises(ProvisionError, match="contains '/'"):
        provision(tmp_path, FED, ["a/b"])
    with pytest.raises(ProvisionError, match="name the server"):
        provision(tmp_path, FED, ["feast-server"])


def test_a_broken_bundle_is_a_clear_error(tmp_path: Path) -> None:
    done = provision(tmp_path, FED, ["jet"])
    with pytest.raises(CredentialsError, match="no bundle.json"):
        load_credentials(tmp_path / "nowhere")
    (done.devices["jet"] / "client.key").unlink()
    with pytest.raises(CredentialsError, match="key file 'client.key' is missing"):
        load_credentials(done.devices["jet"])
    bundle = done.server / "bundle.json"
    bundle.write_text(json.dumps({**json.loads(bundle.read_text()), "version": 99}))
    with pytest.raises(CredentialsError, match="version 99"):
        load_credentials(done.server)


# --------------------------------------------------------------------------- the broker enforces the identities


def test_anonymous_and_plain_clients_are_refused(provisioned: ProvisionedBroker) -> None:
    ca = load_credentials(provisioned.done.server).ca_file
    anonymous = Raw(provisioned.port, ca=ca)
    assert not anonymous.connect()
    assert not Raw(provisioned.port, ca=None, tls=False).connect()  # no plain listener
    if provisioned.auth == "password":
        assert not Raw(provisioned.port, ca=ca, user=("jet", "wrong")).connect()
    anonymous.close()


def test_the_acl_pins_each_device_to_its_own_topics(provisioned: ProvisionedBroker) -> None:
    server = raw_as(provisioned, "server")  # raw: this test is about the broker alone, not the signatures
    server.client.subscribe(T.all, qos=1)
    seen = server.received
    attacker = raw_as(provisioned, "jet")
    try:
        for topic in (T.ctrl("pi"), T.xfer("down", "pi"), T.events("+"), T.register("pi"), T.all):
            attacker.client.subscribe(topic, qos=1)
        for topic in (
            T.events("pi"),
            T.register("pi"),
            T.status("pi"),
            T.xfer("up", "pi"),
            T.nack("down", "pi"),
            T.ctrl("pi"),
            T.server_status,
        ):
            attacker.client.publish(topic, b"forged", qos=1).wait_for_publish(5)
        attacker.client.publish(T.events("jet"), b"own topic", qos=1).wait_for_publish(5)
        for topic in (T.ctrl("pi"), T.xfer("down", "pi"), T.nack("up", "pi")):
            server.client.publish(topic, b"for pi", qos=1).wait_for_publish(5)
        assert wait_until(lambda: T.events("jet") in [m.topic for m in seen])
        time.sleep(0.5)
        let_through = [m.topic for m in seen if m.topic not in (T.ctrl("pi"), T.xfer("down", "pi"), T.nack("up", "pi"))]
        assert let_through == [T.events("jet")], f"the broker let {let_through} through"
        assert [m.topic for m in attacker.received] == [], "jet read pi's downlinks"
    finally:
        attacker.close()
        server.close()


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.05)
    return bool(predicate())


# --------------------------------------------------------------------------- signatures (a broker that enforces nothing)


def test_unsigned_and_re_addressed_messages_never_reach_the_server(
    tmp_path: Path, federation: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On the open shared broker only the signatures stand between a stranger and the server."""
    caplog.set_level(logging.WARNING)
    done = provision(tmp_path, federation, ["jet", "pi"])
    t = Topics(federation)
    server = Link(load_credentials(done.server).link_config(broker="mqtt://127.0.0.1:1883"))
    got: list[bytes] = []
    server.subscribe(t.register("+"), lambda r: got.append(r.payload))
    server.connect(timeout=5)
    jet = Link(load_credentials(done.devices["jet"]).link_config(broker="mqtt://127.0.0.1:1883"))
    replies: list[bytes] = []
    jet.subscribe(t.ctrl("jet"), lambda r: replies.append(r.payload))
    jet.connect(timeout=5)
    stranger = Link(LinkConfig(broker="mqtt://127.0.0.1:1883"))
    stranger.connect(timeout=5)
    captured: list[bytes] = []
    spy = Link(LinkConfig(broker="mqtt://127.0.0.1:1883"))
    spy.subscribe(t.register("jet"), lambda r: captured.append(r.payload))
    spy.connect(timeout=5)
    try:
        message = Register(
            federation=federation,
            round=0,
            device="pi",
            host="pi",
            instance="i1",
            preset="fmnist-small",
            preset_digest="0" * 64,
            budget_macs=1,
            samples=1,
            profile={},
        ).encode()
        stranger.publish(t.register("pi"), message, timeout=5)  # unsigned
        jet.publish(t.register("jet"), b'{"jet": "genuine"}', timeout=5)
        assert wait_until(lambda: captured)
        stranger.publish(t.register("pi"), captured[0], timeout=5)  # jet's signed message, re-addressed to pi
        stranger.publish(
            t.ctrl("jet"),
            Registered(
                federation=federation, round=0, device="jet", instance="x", accepted=False, reason="forged"
            ).encode(),
            timeout=5,
        )
        assert wait_until(lambda: got == [b'{"jet": "genuine"}'])
        server.publish(t.ctrl("jet"), b"genuine reply", timeout=5)
        assert wait_until(lambda: replies)
        time.sleep(0.5)
        assert got == [b'{"jet": "genuine"}'] and replies == [b"genuine reply"]
        dropped = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
        assert any("unsigned message on" in d for d in dropped) and any("valid signature" in d for d in dropped), (
            dropped
        )
    finally:
        for link in (server, jet, stranger, spy):
            link.close()


# --------------------------------------------------------------------------- a provisioned federation


@pytest.mark.slow  # a provisioned broker, a server thread and real agent processes
@pytest.mark.broker
def test_a_provisioned_federation_trains_and_refuses_what_the_identities_do_not_allow(
    kit, tmp_path: Path, partition: Path, agent_cli
) -> None:
    entries = read_index(partition)["clients"]
    running = start_provisioned(tmp_path / "provision", "certificate", ["jet", "pi"], federation="prov")
    try:
        server_link = load_credentials(running.done.server).link_config()
        config = kit.server_config(
            kit.CONFIG, tmp_path / "run", partition, "prov", rounds=1, per_round=2, min_clients=2, start_clients=2
        )
        server = kit.ServerThread(config, link=server_link).start()
        url = f"mqtts://127.0.0.1:{running.port}"
        agents = [
            kit.spawn_agent(
                tmp_path / "logs",
                name,
                partition / entry["file"],
                "prov",
                "--credentials",
                str(running.done.devices[name]),
                broker=url,
            )
            for name, entry in zip(["jet", "pi"], entries)
        ]
        try:
            history = server.join(240)
        finally:
            codes = [kit.stop(a) for a in agents]
            server.close()
        assert history[0].applied and sorted(history[0].updated) == ["jet", "pi"]
        assert codes == [0, 0], [kit.log_text(a)[-800:] for a in agents]
        # A device bundle is one identity: it cannot host another device id or be used as the server's.
        shard = str(partition / entries[0]["file"])
        mismatch = agent_cli.run(
            "run", "--credentials", str(running.done.devices["jet"]), "--device-id", "pi", "--data", shard
        )
        agent_cli.assert_user_error(mismatch, "differs from the credentials bundle's identity 'jet'")
        agent_cli.assert_user_error(
            agent_cli.run("run", "--credentials", str(running.done.server), "--data", shard), "the server's bundle"
        )
    finally:
        running.broker.stop()


def _accepts(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _outside_address() -> str | None:
    """An address of this machine that is not loopback (what another machine on the network would connect to)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.broker
def test_provision_listen_binds_the_generated_broker_to_one_address(tmp_path: Path, server_cli) -> None:
    outside = _outside_address()
    for listen in ("127.0.0.1", None):
        port, root = free_port(), tmp_path / str(listen)
        args = ["provision", "--out", str(root), "--federation", FED, "--device", "jet", "--broker-port", str(port)]
        args += ["--broker-user", getpass.getuser(), *(["--listen", listen] if listen else [])]
        done = server_cli.invoke(*args)
        assert done.returncode == 0, done.stderr
        assert f"TLS on {listen or 'every interface'}, port {port}" in done.stdout
        conf = (root / "broker" / "mosquitto.conf").read_text()
        assert f"\nlistener {port} 127.0.0.1\n" in conf if listen else f"\nlistener {port}\n" in conf
        broker = start_mosquitto(root / "broker" / "mosquitto.conf", port, root / "broker.log", url="", enforces="")
        try:
            assert _accepts("127.0.0.1", port)
            if outside is not None:  # bound to loopback: nobody else reaches it; unbound: everyone may
                assert _accepts(outside, port) is (listen is None), outside
        finally:
            broker.stop()
    for bad in ("127.0.0.1\nallow_anonymous true", "0.0.0.0 1883", "-bad-.example", "a" * 300):
        refused = server_cli.invoke("provision", "--out", str(tmp_path / "bad"), "--device", "jet", "--listen", bad)
        server_cli.assert_user_error(refused, "is not an IP address or host name")
