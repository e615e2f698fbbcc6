"""The transport end to end through real Mosquitto brokers: the shared one at 127.0.0.1:1883 and our own for auth/TLS."""

from __future__ import annotations

import getpass
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ports import free_port, free_ports

from feast_edge.transport.broker import LinkConfig, parse_broker_url
from feast_edge.transport.chunks import Reassembler, Status
from feast_edge.transport.errors import BrokerAuthError, BrokerTlsError, BrokerUnreachableError, LinkError
from feast_edge.transport.frames import TransferInfo, encode_frame
from feast_edge.transport.link import Link, Received
from feast_edge.transport.messages import Nack, Presence, parse
from feast_edge.transport.retained import clear_retained
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender

REPO = Path(__file__).resolve().parents[2]
LOCAL = "mqtt://127.0.0.1:1883"
USER, PASSWORD = "alice", "s3cret-pw"


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def local_broker() -> str:
    assert port_open(1883), (
        "no MQTT broker at 127.0.0.1:1883: start it with 'mosquitto -d -c /etc/mosquitto/mosquitto.conf' (.ci/run does)"
    )
    return LOCAL


@pytest.fixture
def fed() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_link(local_broker: str) -> Iterator[Callable[..., Link]]:
    """Connected links that are closed, and whose retained presence is cleared, after the test."""
    links: list[Link] = []

    def make(presence: Presence | None = None, **config: object) -> Link:
        link = Link(LinkConfig(**{"broker": local_broker, **config}), presence=presence)  # type: ignore[arg-type]
        link.connect(timeout=5)
        links.append(link)
        return link

    yield make
    for link in links:
        link.close()
    retained = [link.status_topic for link in links if link.status_topic]
    if retained:
        cleaner = Link(LinkConfig(broker=local_broker))
        cleaner.connect(timeout=5)
        for topic in retained:
            cleaner.publish(topic, b"", retain=True, timeout=5)
        cleaner.close()


class Collector:
    """A handler that records messages and lets a test wait for one."""

    def __init__(self) -> None:
        self.messages: list[Received] = []
        self.changed = threading.Condition()

    def __call__(self, message: Received) -> None:
        with self.changed:
            self.messages.append(message)
            self.changed.notify_all()

    def wait(self, predicate: Callable[[Received], bool], timeout: float = 5.0) -> Received:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for message in self.messages:
                    if predicate(message):
                        return message
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no matching message within {timeout} s; got {[m.topic for m in self.messages]}"
                self.changed.wait(remaining)


# --- chunked transfers through 127.0.0.1:1883 ---------------------------------------------------


def test_five_megabyte_round_trip(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    server, device = make_link(), make_link()
    sender = ChunkSender(server, topics, "down", chunk_size=256 * 1024)
    receiver = ChunkReceiver(device, topics, "down", device="jetson-1")
    payload = random.Random(0).randbytes(5 * 1024 * 1024 + 123)
    info = sender.send(payload, round=1, device="jetson-1", timeout=30)
    assert info.count == 21
    result = receiver.get(timeout=30)
    assert result is not None and result.status is Status.COMPLETE
    assert result.payload == payload and result.info == info
    receipt = sender.wait_receipt(info.transfer, timeout=5)
    assert receipt is not None and receipt.ok
    assert info.transfer not in sender.outbox  # released on the receipt


def test_upload_from_device_to_server_filter(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    server, device = make_link(), make_link()
    receiver = ChunkReceiver(server, topics, "up")  # every device
    sender = ChunkSender(device, topics, "up", device="pi-5", chunk_size=1000)
    info = sender.send(b"u" * 4500, round=2, device="pi-5")
    result = receiver.get(timeout=10)
    assert result is not None and result.payload == b"u" * 4500 and result.info.device == "pi-5"
    assert sender.wait_receipt(info.transfer, timeout=5).ok  # type: ignore[union-attr]


def test_reordered_and_duplicated_chunks_reassemble(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    server, device = make_link(), make_link()
    receiver = ChunkReceiver(device, topics, "down", device="d1")
    sender = ChunkSender(server, topics, "down", chunk_size=4096)
    payload = random.Random(1).randbytes(100_000)
    info = sender.outbox.add(payload, federation=fed, round=1, device="d1")
    frames = list(sender.outbox.frames(info.transfer))
    rng = random.Random(2)
    stream = frames + rng.sample(frames, 10)
    rng.shuffle(stream)
    server.publish_many(topics.xfer("down", "d1"), stream, timeout=10)
    result = receiver.get(timeout=10)
    assert result is not None and result.status is Status.COMPLETE and result.payload == payload
    assert receiver.results.empty()  # the duplicates produced nothing more


def test_dropped_chunks_are_nacked_and_resent(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    server, device, spy = make_link(), make_link(), make_link()
    nacks = Collector()
    spy.subscribe(topics.nack("down", "+"), nacks)
    sender = ChunkSender(server, topics, "down", chunk_size=1000)
    receiver = ChunkReceiver(device, topics, "down", device="d1", nack_after=0.3)
    payload = random.Random(3).randbytes(10_000)
    info = sender.outbox.add(payload, federation=fed, round=4, device="d1")
    frames = list(sender.outbox.frames(info.transfer))
    kept = [frames[i] for i in (0, 1, 4, 5, 9)]  # the network "lost" 2, 3, 6, 7, 8
    server.publish_many(topics.xfer("down", "d1"), kept, timeout=10)
    result = receiver.get(timeout=10)
    assert result is not None and result.status is Status.COMPLETE and result.payload == payload
    nack = parse(nacks.wait(lambda m: parse(m.payload).kind == "nack").payload)
    assert isinstance(nack, Nack) and nack.missing == (2, 3, 6, 7, 8) and nack.round == 4 and nack.device == "d1"
    assert sender.wait_receipt(info.transfer, timeout=5).ok  # type: ignore[union-attr]


def test_announced_transfer_whose_chunks_all_vanished_is_fetched(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    server, device = make_link(), make_link()
    sender = ChunkSender(server, topics, "down", chunk_size=100)
    receiver = ChunkReceiver(device, topics, "down", device="d1", nack_after=0.2)
    info = sender.outbox.add(b"z" * 1000, federation=fed, round=1, device="d1")  # held, never published
    receiver.expect(TransferInfo.from_dict(info.to_dict()))  # as announced in a RoundStart message
    result = receiver.get(timeout=10)
    assert result is not None and result.payload == b"z" * 1000


def test_corrupted_chunk_is_rejected_and_the_sender_told(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    server, device = make_link(), make_link()
    sender = ChunkSender(server, topics, "down", chunk_size=1000)
    receiver = ChunkReceiver(device, topics, "down", device="d1")
    info = sender.outbox.add(b"a" * 3000, federation=fed, round=1, device="d1")
    frames = list(sender.outbox.frames(info.transfer))
    frames[1] = frames[1][:-1] + b"b"
    server.publish_many(topics.xfer("down", "d1"), frames, timeout=10)
    result = receiver.get(timeout=10)
    assert result is not None and result.status is Status.REJECTED and "sha256 mismatch" in result.reason
    receipt = sender.wait_receipt(info.transfer, timeout=5)
    assert receipt is not None and not receipt.ok and "sha256 mismatch" in receipt.reason


def test_a_payload_that_fails_its_hash_is_fetched_again_once(make_link: Callable[..., Link], fed: str) -> None:
    """One flipped bit in one chunk (issue 21, item 4): a receiver allowed one refetch nacks every chunk, the sender
    (holding the payload: no receipt yet) sends them again, and the transfer completes; corrupted twice, it is rejected."""
    from feast_edge.transport.chunks import Reassembler

    topics = Topics(fed)
    server, device = make_link(), make_link()
    sender = ChunkSender(server, topics, "down", chunk_size=1000)
    receiver = ChunkReceiver(
        device, topics, "down", device="d1", nack_after=0.2, reassembler=Reassembler(federation=fed, refetch=1)
    )
    payload = bytes(range(256)) * 12
    for corruptions, expected in ((1, Status.COMPLETE), (2, Status.REJECTED)):
        info = sender.outbox.add(payload, federation=fed, round=1, device="d1")
        receiver.expect(info)
        good = list(sender.outbox.frames(info.transfer))
        bad = [*good]
        bad[2] = bad[2][:-1] + bytes([bad[2][-1] ^ 1])
        server.publish_many(topics.xfer("down", "d1"), bad, timeout=10)
        if corruptions == 2:  # the attacker corrupts the resent copy too: it arrives before the sender's resend
            time.sleep(0.05)
            server.publish_many(topics.xfer("down", "d1"), bad, timeout=10)
        result = receiver.get(timeout=10)
        assert result is not None and result.status is expected, (result, corruptions)
        if expected is Status.COMPLETE:
            assert result.payload == payload
        else:
            assert "sha256 mismatch" in result.reason
        receipt = sender.wait_receipt(info.transfer, timeout=5)
        assert receipt is not None and receipt.ok is (expected is Status.COMPLETE)


def test_malformed_traffic_is_dropped_and_logged(
    make_link: Callable[..., Link], fed: str, caplog: pytest.LogCaptureFixture
) -> None:
    topics = Topics(fed)
    server, device, rogue = make_link(), make_link(), make_link()
    sender = ChunkSender(server, topics, "down", chunk_size=1000)
    receiver = ChunkReceiver(device, topics, "down", device="d1")
    other = TransferInfo(federation=fed, round=1, device="d2", transfer="x1", count=1, size=1, chunk=1, sha256="0" * 64)
    with caplog.at_level(logging.WARNING, logger="feast_edge.transport"):
        for junk in (b"", b"\x00\x00\x00\x05{oops", os.urandom(300), encode_frame(other, 0, b"q")):
            rogue.publish(topics.xfer("down", "d1"), junk, timeout=5)
        for junk in (
            b"not json",
            b'{"v":1,"kind":"nack"}',
            Nack(federation=fed, round=1, device="d9", transfer="x", missing=(1,)).encode(),
        ):
            rogue.publish(topics.nack("down", "d1"), junk, timeout=5)
        sender.send(b"still fine" * 300, round=1, device="d1")
        result = receiver.get(timeout=10)
    assert result is not None and result.payload == b"still fine" * 300
    log = caplog.text
    assert "dropped chunk" in log and "arrived on the topic of device 'd1'" in log
    assert "dropped feedback" in log and "not valid JSON" in log and "names device 'd9'" in log


def test_a_handler_that_fails_on_every_message_logs_a_few_lines_and_keeps_serving(
    make_link: Callable[..., Link], fed: str, caplog: pytest.LogCaptureFixture
) -> None:
    """301 messages that each make the handler raise: at most 5 error lines a minute per channel, no traceback outside
    the debug log, and the link still delivers (issue 21, item 2)."""
    topics = Topics(fed)
    server, rogue = make_link(), make_link()
    calls: list[bytes] = []

    def handler(received: Received) -> None:
        calls.append(received.payload)
        if received.payload != b"fine":
            raise ValueError(f"cannot handle {received.payload[:10]!r}")

    server.subscribe(topics.events("+"), handler)
    with caplog.at_level(logging.DEBUG, logger="feast_edge.transport"):
        rogue.publish_many(topics.events("mallory"), (b"bad %d" % i for i in range(301)), window=64)
        rogue.publish(topics.events("mallory"), b"fine", timeout=5)
        assert wait_for(lambda: calls[-1:] == [b"fine"], timeout=20), len(calls)
    failures = [r for r in caplog.records if "handler for" in r.getMessage()]
    errors = [r for r in failures if r.levelno >= logging.ERROR]
    assert 1 <= len(errors) <= 5 and all(r.exc_info is None for r in errors)
    assert "ValueError: cannot handle" in errors[0].getMessage()
    debug = [r for r in failures if r.levelno == logging.DEBUG]
    assert len(debug) == 301 and all(r.exc_info is not None for r in debug)  # full detail in the debug log


# --- presence ------------------------------------------------------------------------------------


def presence_of(message: Received) -> Presence:
    parsed = parse(message.payload)
    assert isinstance(parsed, Presence)
    return parsed


def test_retained_presence_and_clean_shutdown(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    device = make_link(Presence(federation=fed, round=0, device="jetson-1", state="online"))
    make_link(Presence(federation=fed, round=0, device="server", state="online", role="server"))  # the server, present
    late = make_link()  # subscribes after both announced themselves: sees the retained status
    seen = Collector()
    late.subscribe(topics.status("+"), seen)
    late.subscribe(topics.server_status, seen)
    online = seen.wait(lambda m: m.topic == topics.status("jetson-1"))
    assert online.retain and presence_of(online).state == "online"
    assert presence_of(seen.wait(lambda m: m.topic == topics.server_status)).role == "server"
    device.close()
    offline = seen.wait(lambda m: m.topic == topics.status("jetson-1") and presence_of(m).state == "offline")
    assert not offline.retain  # live delivery; the broker keeps it retained for later subscribers
    again = make_link()
    retained = Collector()
    again.subscribe(topics.status("jetson-1"), retained)
    assert presence_of(retained.wait(lambda m: m.retain)).state == "offline"


_CRASHER = """
import sys, time
sys.path.insert(0, {repo!r})
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.link import Link
from feast_edge.transport.messages import Presence
link = Link(LinkConfig(broker={broker!r}, keepalive=60), presence=Presence(federation={fed!r}, round=0, device="doomed", state="online"))
link.connect(timeout=5)
print("ready", flush=True)
time.sleep(60)
"""


def test_last_will_announces_a_crashed_device(make_link: Callable[..., Link], fed: str, local_broker: str) -> None:
    topics = Topics(fed)
    observer = make_link()
    seen = Collector()
    observer.subscribe(topics.status("doomed"), seen)
    code = _CRASHER.format(repo=str(REPO), broker=local_broker, fed=fed)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        assert presence_of(seen.wait(lambda m: presence_of(m).state == "online", timeout=5)).device == "doomed"
        process.send_signal(signal.SIGKILL)  # no DISCONNECT: the broker must publish the will
        process.wait(timeout=5)
        will = seen.wait(lambda m: presence_of(m).state == "offline", timeout=10)
        assert presence_of(will).device == "doomed"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        observer.publish(topics.status("doomed"), b"", retain=True, timeout=5)


def test_reconnects_resubscribes_and_delivers_queued_messages(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    link = make_link(
        Presence(federation=fed, round=0, device="flaky", state="online"),
        reconnect_min_delay=0.1,
        reconnect_max_delay=0.5,
    )
    other = make_link()
    inbox = Collector()
    link.subscribe(topics.ctrl("flaky"), inbox)
    presences = Collector()
    other.subscribe(topics.status("flaky"), presences)
    presences.wait(lambda m: True)
    before = len(presences.messages)
    link._client.socket().shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]  # the network drops
    assert wait_for(lambda: not link.connected, timeout=5)
    link.publish(topics.events("d1"), b"queued while offline", timeout=10)  # waits through the reconnect
    assert link.wait_connected(timeout=10)
    assert wait_for(lambda: len(presences.messages) > before, timeout=5)  # online status published again
    other.publish(topics.ctrl("flaky"), b"after reconnect", timeout=5)
    assert inbox.wait(lambda m: m.payload == b"after reconnect").topic == topics.ctrl("flaky")


def test_unhandled_topics_go_to_the_inbox_and_handler_errors_are_contained(
    make_link: Callable[..., Link], fed: str
) -> None:
    topics = Topics(fed)
    link, other = make_link(), make_link()
    link.subscribe(topics.events("d1"))

    def broken(message: Received) -> None:
        raise RuntimeError("handler bug")

    link.subscribe(topics.register("d1"), broken)
    other.publish(topics.register("d1"), b"boom", timeout=5)
    other.publish(topics.events("d1"), b"hello", timeout=5)
    received = link.get(timeout=5)
    assert received is not None and received.payload == b"hello"
    assert link.connected


def test_filters_subscribed_before_connect_are_live_when_it_returns(
    local_broker: str, make_link: Callable[..., Link], fed: str
) -> None:
    topics = Topics(fed)
    link = Link(LinkConfig(broker=local_broker))
    link.subscribe(topics.events("d1"))
    link.connect(timeout=5)
    try:
        make_link().publish(topics.events("d1"), b"early", timeout=5)
        received = link.get(timeout=5)
        assert received is not None and received.payload == b"early"
    finally:
        link.close()


def test_a_handler_cannot_block_on_a_puback(
    make_link: Callable[..., Link], fed: str, caplog: pytest.LogCaptureFixture
) -> None:
    topics = Topics(fed)
    link = make_link()
    link.subscribe(topics.events("d1"), lambda message: link.publish(topics.register("d1"), b"x", timeout=5))
    with caplog.at_level(logging.ERROR, logger="feast_edge.transport"):
        link.publish(topics.events("d1"), b"trigger", timeout=5)
        assert wait_for(lambda: "a handler cannot wait for a PUBACK" in caplog.text, timeout=5)
    assert link.connected


def test_clean_close_logs_nothing_at_error_level(
    make_link: Callable[..., Link], fed: str, caplog: pytest.LogCaptureFixture
) -> None:
    topics = Topics(fed)
    observer = make_link()
    seen = Collector()
    observer.subscribe(topics.events("d1"), seen)
    link = Link(LinkConfig(broker=LOCAL), presence=Presence(federation=fed, round=0, device="leaving", state="online"))
    with caplog.at_level(logging.DEBUG, logger="feast_edge.transport"):
        link.connect(timeout=5)
        stop_loop = link._client.loop_stop

        def late_loop_stop() -> object:
            # The race close() loses: paho's thread sends DISCONNECT and closes the socket before it is stopped.
            wait_for(lambda: link._client.socket() is None, timeout=5)
            return stop_loop()

        link._client.loop_stop = late_loop_stop  # type: ignore[method-assign]
        link.publish(topics.events("d1"), b"last words")  # not awaited: close() still delivers it
        link.close()
    assert seen.wait(lambda m: m.payload == b"last words").topic == topics.events("d1")
    assert "Sending DISCONNECT" in caplog.text
    assert [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR] == []
    observer.publish(topics.status("leaving"), b"", retain=True, timeout=5)


def test_mqtt5_protocol_option(make_link: Callable[..., Link], fed: str) -> None:
    topics = Topics(fed)
    link = make_link(protocol="5")
    link.subscribe(topics.events("d1"))
    link.publish(topics.events("d1"), b"v5", timeout=5)
    received = link.get(timeout=5)
    assert received is not None and received.payload == b"v5"


# --- connection errors ---------------------------------------------------------------------------


def test_unreachable_broker_is_a_clear_error() -> None:
    port = free_port()
    link = Link(LinkConfig(broker=f"mqtt://127.0.0.1:{port}"))
    with pytest.raises(BrokerUnreachableError) as error:
        link.connect(timeout=3)
    assert str(error.value) == (
        f"cannot reach MQTT broker at 127.0.0.1:{port}: connection refused; is the broker running? check --broker"
    )
    # The refusal is final at once: no background thread was left retrying (it would have kept connect() from failing fast).
    assert not link.connected and not any(
        t.name.startswith(f"paho-mqtt-client-{link.client_id}") for t in threading.enumerate()
    )


def test_silent_server_times_out_instead_of_hanging() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(LinkError, match=f"127.0.0.1:{port} sent no CONNACK within 0.5 s"):
            Link(LinkConfig(broker=f"mqtt://127.0.0.1:{port}")).connect(timeout=0.5)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mqtt://broker.lab:1884", ("broker.lab", 1884, False, None, None)),
        ("mqtts://broker.lab", ("broker.lab", 8883, True, None, None)),
        ("mqtt://u%40x:p%3Aw@10.0.0.2", ("10.0.0.2", 1883, False, "u@x", "p:w")),
        ("127.0.0.1:1883", ("127.0.0.1", 1883, False, None, None)),
        ("mqtt://[::1]:1999", ("::1", 1999, False, None, None)),
    ],
)
def test_parse_broker_url(url: str, expected: tuple[object, ...]) -> None:
    a = parse_broker_url(url)
    assert (a.host, a.port, a.tls, a.username, a.password) == expected


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://x:1", "scheme 'http'"),
        ("mqtt://x:99999", "invalid port"),
        ("mqtt://:1883", "names no host"),
        ("mqtt://x/a", "path"),
    ],
)
def test_bad_broker_urls(url: str, needle: str) -> None:
    with pytest.raises(LinkError, match=needle):
        parse_broker_url(url)


def test_tls_options_need_a_tls_url() -> None:
    with pytest.raises(LinkError, match="need a TLS broker URL.*use mqtts://127.0.0.1:1883"):
        Link(LinkConfig(broker=LOCAL, ca_file="ca.pem"))


# --- our own broker: credentials and TLS -----------------------------------------------------------


@dataclass(frozen=True)
class SecureBroker:
    plain: str  # mqtt://, password required
    tls: str  # mqtts://, password required
    mutual: str  # mqtts://, client certificate required
    ca: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_certificates(d: Path) -> None:
    """Throwaway CA (ca.pem) signing a server (server.pem/key, for 127.0.0.1 and localhost) and a client (client.pem/key)."""
    ec_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec_key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=feast test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )
    extensions = {
        "server": "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        "client": "extendedKeyUsage=clientAuth\n",
    }
    for name, extra in extensions.items():
        (d / f"{name}.ext").write_text(
            f"basicConstraints=critical,CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n{extra}"
        )
        _openssl("req", *ec_key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-set_serial",
            str(random.getrandbits(63)),
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
            "-out",
            f"{name}.pem",
            cwd=d,
        )


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    """A private mosquitto on free loopback ports: password listener, TLS listener, mutual-TLS listener."""
    d = tmp_path_factory.mktemp("mosquitto")
    _make_certificates(d)
    ca_file, server_cert, server_key_file = d / "ca.pem", d / "server.pem", d / "server.key"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(d / "passwd"), USER, PASSWORD], check=True, capture_output=True, timeout=10
    )
    plain, tls, mutual = free_ports(3)
    tls_files = f"cafile {ca_file}\ncertfile {server_cert}\nkeyfile {server_key_file}\n"
    (d / "mosquitto.conf").write_text(
        # user: started as root, mosquitto drops to user mosquitto, which cannot read pytest's private tmp dir.
        f"user {getpass.getuser()}\nper_listener_settings true\npersistence false\nlog_dest stderr\n"
        f"listener {plain} 127.0.0.1\nallow_anonymous false\npassword_file {d / 'passwd'}\n"
        f"listener {tls} 127.0.0.1\nallow_anonymous false\npassword_file {d / 'passwd'}\n{tls_files}"
        f"listener {mutual} 127.0.0.1\nallow_anonymous true\n{tls_files}require_certificate true\n"
    )
    log = open(d / "mosquitto.log", "w")
    process = subprocess.Popen(["mosquitto", "-c", str(d / "mosquitto.conf")], stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_for(lambda: all(port_open(p) for p in (plain, tls, mutual)), timeout=5):
            pytest.fail(f"private mosquitto did not start: {(d / 'mosquitto.log').read_text()}")
        yield SecureBroker(
            plain=f"mqtt://127.0.0.1:{plain}",
            tls=f"mqtts://127.0.0.1:{tls}",
            mutual=f"mqtts://127.0.0.1:{mutual}",
            ca=str(ca_file),
            client_cert=str(d / "client.pem"),
            client_key=str(d / "client.key"),
        )
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        log.close()


def _round_trip(config: LinkConfig) -> None:
    link = Link(config)
    link.connect(timeout=5)
    try:
        link.subscribe("feast/secure/events")
        link.publish("feast/secure/events", b"ping", timeout=5)
        received = link.get(timeout=5)
        assert received is not None and received.payload == b"ping"
    finally:
        link.close()


def test_right_credentials_connect(secure_broker: SecureBroker) -> None:
    _round_trip(LinkConfig(broker=secure_broker.plain, username=USER, password=PASSWORD))
    user_in_url = secure_broker.plain.replace("mqtt://", f"mqtt://{USER}:{PASSWORD}@")
    _round_trip(LinkConfig(broker=user_in_url))


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_wrong_credentials_are_a_clear_error(secure_broker: SecureBroker, protocol: str) -> None:
    address = secure_broker.plain.removeprefix("mqtt://")
    with pytest.raises(BrokerAuthError) as error:
        Link(LinkConfig(broker=secure_broker.plain, username=USER, password="wrong", protocol=protocol)).connect(
            timeout=5
        )
    message = str(error.value)
    assert message.startswith(f"MQTT broker at {address} rejected the credentials of user 'alice' (")
    assert message.endswith("); check --username/--password")


def test_missing_credentials_are_a_clear_error(secure_broker: SecureBroker) -> None:
    with pytest.raises(
        BrokerAuthError, match="rejected the credentials of a client without a username .*check --username/--password"
    ):
        Link(LinkConfig(broker=secure_broker.plain)).connect(timeout=5)


def test_tls_with_ca_file(secure_broker: SecureBroker) -> None:
    _round_trip(LinkConfig(broker=secure_broker.tls, ca_file=secure_broker.ca, username=USER, password=PASSWORD))


def test_tls_insecure_skips_verification(secure_broker: SecureBroker) -> None:
    _round_trip(LinkConfig(broker=secure_broker.tls, tls_insecure=True, username=USER, password=PASSWORD))


def test_tls_unknown_ca_is_a_clear_error(secure_broker: SecureBroker) -> None:
    with pytest.raises(
        BrokerTlsError, match="certificate verify failed|self.signed|unable to get local issuer"
    ) as error:
        Link(LinkConfig(broker=secure_broker.tls, username=USER, password=PASSWORD)).connect(timeout=5)
    assert "check --ca-file" in str(error.value)


def test_tls_url_on_a_plain_port_is_a_clear_error(secure_broker: SecureBroker) -> None:
    plain_as_tls = secure_broker.plain.replace("mqtt://", "mqtts://")
    with pytest.raises(BrokerTlsError, match="is 127.0.0.1:[0-9]+ a TLS listener"):
        Link(LinkConfig(broker=plain_as_tls, ca_file=secure_broker.ca)).connect(timeout=5)


def test_plain_url_on_a_tls_port_is_a_clear_error(secure_broker: SecureBroker) -> None:
    tls_as_plain = secure_broker.tls.replace("mqtts://", "mqtt://")
    with pytest.raises(LinkError, match="if 127.0.0.1:[0-9]+ is a TLS listener use mqtts://"):
        Link(LinkConfig(broker=tls_as_plain, username=USER, password=PASSWORD)).connect(timeout=5)


def test_mutual_tls_with_a_client_certificate(secure_broker: SecureBroker) -> None:
    _round_trip(
        LinkConfig(
            broker=secure_broker.mutual,
            ca_file=secure_broker.ca,
            cert_file=secure_broker.client_cert,
            key_file=secure_broker.client_key,
        )
    )
    with pytest.raises(LinkError, match="--cert-file/--key-file"):
        Link(LinkConfig(broker=secure_broker.mutual, ca_file=secure_broker.ca)).connect(timeout=5)


def test_missing_tls_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(BrokerTlsError, match="cannot load CA file .*check --ca-file"):
        Link(LinkConfig(broker="mqtts://127.0.0.1:8883", ca_file=str(tmp_path / "nope.pem")))
    with pytest.raises(BrokerTlsError, match="check --cert-file/--key-file"):
        Link(LinkConfig(broker="mqtts://127.0.0.1:8883", cert_file=str(tmp_path / "nope.pem")))


def test_clear_retained_removes_every_retained_message_under_the_filter_and_nothing_else(local_broker: str) -> None:
    prefix, other = f"feast/t{uuid.uuid4().hex[:12]}", f"feast/t{uuid.uuid4().hex[:12]}"
    with Link(LinkConfig(broker=local_broker)) as link:
        link.connect(timeout=5)
        for topic in (f"{prefix}/status/a", f"{prefix}/status/b", f"{prefix}/server/status", f"{other}/status/c"):
            link.publish(topic, b"online", retain=True, timeout=5)
    assert clear_retained(LinkConfig(broker=local_broker), f"{prefix}/#") == 3
    assert clear_retained(LinkConfig(broker=local_broker), f"{prefix}/#") == 0  # gone from the broker
    assert clear_retained(LinkConfig(broker=local_broker), f"{other}/#") == 1  # another prefix was left alone


def test_a_stalled_transfer_is_nacked_every_time_but_logged_a_few_times_a_minute(
    local_broker: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35: a transfer that never completes was asked again every second, one log line each (59 per minute)."""
    caplog.set_level(logging.INFO, logger="feast_edge.transport.transfer")
    topics = Topics(f"t{uuid.uuid4().hex[:12]}")
    with Link(LinkConfig(broker=local_broker)) as link:
        link.connect(timeout=5)
        nacks: list[bytes] = []
        link.subscribe(topics.nack("down", "d"), lambda r: nacks.append(r.payload))
        receiver = ChunkReceiver(link, topics, "down", device="d", reassembler=Reassembler(ttl=3600.0))
        info = TransferInfo(
            federation=topics.federation, round=0, device="d", transfer="stuck", count=4, size=16, chunk=4,
            sha256="0" * 64,
        )  # fmt: skip
        receiver.expect(info)
        start = time.monotonic()
        for second in range(1, 61):
            receiver.poll(now=start + second)
        assert wait_for(lambda: len(nacks) == 60)  # the sender is asked every time
    lines = [r for r in caplog.records if "asking again" in r.getMessage()]
    assert 1 <= len(lines) <= 5, [r.getMessage() for r in lines]
