"""Peak RSS of a feast-server process under hostile floods, each against a fresh server, beside a no-flood baseline of the same run.

    python bench/floods.py [--frames 4000] [--nacks 2000] [--malformed 10000] [--messages 100000] [--requests 100]
                           [--broker-queue 1000] [--only NAME]

Every scenario starts its own mosquitto, a ``feast-server run`` subprocess
(1 round, cohort of 1, ``--serve`` so it stays up to be measured) and one
honest ``feast-agent`` (39M MACs: a 9.9 MB routed payload); the attacker is a
raw paho-mqtt 2 client that watches the honest device's ``ctrl`` topic (no ACL
on the bench broker) and starts its flood the moment the round message goes
out, so the flood and the round overlap. Peak RSS is ``VmHWM`` of the server
process (``/proc/PID/status``), read until the end of the scenario.

floods:
  chunks      frames of an unannounced transfer from a device outside the cohort on xfer/up/{device}
  huge        single small frames (and an update) declaring a 1 TiB transfer
  nacks       nacks on xfer/nack/down/{device} asking for every chunk of the round's routed payload, again and again
  malformed   deep JSON, bad UTF-8, 1e999, oversize and shapeless messages on register/{device} and events/{device}
  messages    small valid metrics messages from a registered device on its own events/{device}
  announcements  a registered device in the cohort (cohort of 2 with the honest one) announcing uploads of its own
              routed slice on events/{device}: fresh transfer ids, no chunks (it holds one upload slot, never more)
  models      model requests for an exported model on events/{device}, against a server that has exported and serves
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.protocol import Metrics, ModelRequest, Register, Registered, RoundStart, Update
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT, RoundRecord
from feast_edge.server.registry import Registry
from feast_edge.space.preset import load_preset
from feast_edge.transport.frames import MiB, TransferInfo, encode_frame, new_transfer_id
from feast_edge.transport.messages import Nack, Presence, new_msg_id, parse
from feast_edge.transport.topics import Topics

REPO = Path(__file__).resolve().parent.parent
HONEST = "honest"
MALLORY = "mallory"
PRESET = load_preset("fmnist-small")
DROPPED = "$SYS/broker/publish/messages/dropped"  # the broker's own topic, not a federation's


# --------------------------------------------------------------------------- a broker of each scenario's own, and measuring the server


class Broker:
    """mosquitto on a free loopback port; publishes its $SYS counters every second."""

    def __init__(self, work: Path, queue_limit: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"mqtt://127.0.0.1:{port}"
        conf = work / "mosquitto.conf"
        conf.write_text(
            f"user {getpass.getuser()}\npersistence false\nlog_dest stderr\nlistener {port} 127.0.0.1\nallow_anonymous true\n"
            f"sys_interval 1\nmax_queued_messages {queue_limit}\n"
        )
        with open(work / "mosquitto.log", "w") as log:
            self.process = subprocess.Popen(
                [shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                s.settimeout(0.2)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit(f"mosquitto did not start; see {work / 'mosquitto.log'}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class PeakRss:
    """Samples a process's VmHWM (peak resident set) and VmRSS from /proc until it exits; keeps the last values read."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.path = Path(f"/proc/{pid}/status")
        self.peak_kib = 0
        self.before_kib = 0  # VmRSS when mark() was called
        self.since_kib = 0  # the largest VmRSS seen since then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _read(self) -> tuple[int, int] | None:
        try:
            fields = dict(line.split(":", 1) for line in self.path.read_text().splitlines() if ":" in line)
            return int(fields["VmHWM"].split()[0]), int(fields["VmRSS"].split()[0])
        except (OSError, ValueError, KeyError):
            return None

    def _sample(self) -> bool:
        values = self._read()
        if values is None:
            return False
        self.peak_kib = max(self.peak_kib, values[0])
        self.since_kib = max(self.since_kib, values[1])
        return True

    def _run(self, interval: float) -> None:
        while not self._stop.is_set() and self._sample():
            time.sleep(interval)

    def mark(self) -> None:
        """Start measuring the growth of the resident set from now (the flood's start)."""
        values = self._read()
        if values is not None:
            self.before_kib = self.since_kib = values[1]

    def stop(self) -> tuple[float, float]:
        """Peak RSS over the process's life, and the resident set's growth since mark(), in MiB."""
        self._sample()
        self._stop.set()
        self._thread.join(5)
        return self.peak_kib / 1024, (self.since_kib - self.before_kib) / 1024


# --------------------------------------------------------------------------- the attacker


class Attacker:
    """A raw paho-mqtt 2 client: sees what the server sends the honest device, publishes whatever it is told."""

    def __init__(self, url: str, topics: Topics) -> None:
        self.topics = topics
        self.ctrl: queue.Queue = queue.Queue()
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"attacker-{uuid.uuid4().hex[:8]}")
        self.client.max_inflight_messages_set(1000)
        self.dropped = 0  # the broker's count of publishes it dropped at a full subscriber queue
        self.client.on_message = self._on_message
        self.client.connect(host, int(port), keepalive=60)
        self.client.loop_start()
        for device in (HONEST, MALLORY):
            self.client.subscribe(topics.ctrl(device), qos=1)
        self.client.subscribe(DROPPED, qos=0)

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        if message.topic == DROPPED:
            self.dropped = int(message.payload)
        else:
            self.ctrl.put(message.payload)

    def next(self, kind: type, timeout: float, device: str | None = None) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = parse(self.ctrl.get(timeout=0.2))
            except queue.Empty:
                continue
            if isinstance(message, kind) and (device is None or message.device == device):
                return message
        raise SystemExit(f"the attacker saw no {kind.__name__} within {timeout:g} s")

    def flood(self, messages: Iterable[tuple[str, bytes]]) -> tuple[int, int]:
        """Publish every (topic, payload) at QoS 0; the last at QoS 1, whose PUBACK means the broker took them all."""
        count = size = 0
        last = None
        for topic, payload in messages:
            if last is not None:
                self.client.publish(*last, qos=0)
            last = (topic, payload)
            count += 1
            size += len(payload)
        if last is not None:
            self.client.publish(*last, qos=1).wait_for_publish(300)
        return count, size

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def register(self) -> Registered:
        """Become a registered, online device (mallory) the honest way: presence, then a registration."""
        t = self.topics
        self.client.publish(
            t.status(MALLORY),
            Presence(federation=t.federation, round=0, device=MALLORY, state="online").encode(),
            qos=1,
            retain=True,
        )
        message = Register.for_client(
            federation=t.federation,
            device_id=MALLORY,
            host=MALLORY,
            instance=uuid.uuid4().hex[:16],
            preset=PRESET,
            budget_macs=2_000_000,
            samples=10,
            profile={},
        )
        self.client.publish(t.register(MALLORY), message.encode(), qos=1).wait_for_publish(10)
        registered = self.next(Registered, 30)
        assert registered.accepted, registered.reason  # type: ignore[attr-defined]
        return registered  # type: ignore[return-value]


# --------------------------------------------------------------------------- the floods


@dataclasses.dataclass(frozen=True)
class Context:
    topics: Topics
    start: RoundStart | None  # the honest device's round message (None in the serving scenario)
    args: argparse.Namespace
    attacker: Attacker


def chunk_flood(c: Context) -> Iterator[tuple[str, bytes]]:
    chunk = 64 * 1024
    info = TransferInfo(
        federation=c.topics.federation, round=0, device=MALLORY, transfer=new_transfer_id(), count=c.args.frames, size=c.args.frames * chunk, chunk=chunk,
        sha256="0" * 64,
    )  # fmt: skip
    data = os.urandom(chunk)
    for i in range(c.args.frames):
        yield c.topics.xfer("up", MALLORY), encode_frame(info, i, data)


def huge_declaration(c: Context) -> Iterator[tuple[str, bytes]]:
    size, chunk = 2**40 + 1, MiB  # the last chunk of a 1 TiB + 1 B transfer is 1 byte: a 300-byte frame
    assert c.start is not None
    for device in (MALLORY, HONEST):  # a stranger, and the cohort device itself (an unannounced transfer)
        info = TransferInfo(
            federation=c.topics.federation, round=c.start.round, device=device, transfer=new_transfer_id(), count=-(-size // chunk), size=size, chunk=chunk,
            sha256="0" * 64,
        )  # fmt: skip
        yield c.topics.xfer("up", device), encode_frame(info, info.count - 1, b"x")
        update = Update(
            federation=c.topics.federation,
            round=c.start.round,
            device=device,
            transfer=info.to_dict(),
            routed=new_transfer_id(),
            samples=1,
        )
        yield c.topics.events(device), update.encode()


def nack_flood(c: Context) -> Iterator[tuple[str, bytes]]:
    assert c.start is not None
    transfer = c.start.transfer
    everything = tuple(range(int(transfer["count"])))
    for _ in range(c.args.nacks):
        nack = Nack(
            federation=c.topics.federation,
            round=c.start.round,
            device=HONEST,
            transfer=transfer["transfer"],
            missing=everything,
        )
        yield c.topics.nack("down", HONEST), nack.encode()


def malformed_flood(c: Context) -> Iterator[tuple[str, bytes]]:
    fed = c.topics.federation
    kinds = [
        b"[" * 60_000,  # nested 60,000 deep, under the 64 KiB limit
        b'{"a":' * 12_000,
        b"\xff\xfe\xfd" * 50,
        b'{"v":1,"kind":"metrics","federation":"%s","round":0,"device":"junk","msg_id":"%s","values":{"x":1e999}}',
        b" " * 70_000,  # over the 64 KiB limit
        b"[1,2,3]",
        b'{"v":1,"kind":"no-such-kind"}',
        b'{"v":1,"kind":"register","federation":"%s"}',
    ]
    for i in range(c.args.malformed):
        device = f"junk{i % 100}"
        body = kinds[i % len(kinds)]
        if b"%s" in body:
            body = body.replace(b"%s", fed.encode(), 1).replace(b"%s", new_msg_id().encode(), 1)
        topic = c.topics.register(device) if i % 2 else c.topics.events(device)
        yield topic, body


def message_flood(c: Context) -> Iterator[tuple[str, bytes]]:
    c.attacker.register()  # after the round began: the cohort is the honest device alone
    for i in range(c.args.messages):
        yield (
            c.topics.events(MALLORY),
            Metrics(
                federation=c.topics.federation, round=0, device=MALLORY, values={"seq": i, "latency_ms": 1.5}
            ).encode(),
        )


def announcement_flood(c: Context) -> Iterator[tuple[str, bytes]]:
    """Mallory, in the cohort, announces uploads of its own routed slice: fresh transfer ids, never a chunk."""
    assert c.start is not None and c.start.device == MALLORY
    for _ in range(c.args.announcements):
        info = TransferInfo(
            federation=c.topics.federation, round=c.start.round, device=MALLORY, transfer=new_transfer_id(), count=1,
            size=1024, chunk=1024, sha256="0" * 64,
        )  # fmt: skip
        update = Update(
            federation=c.topics.federation,
            round=c.start.round,
            device=MALLORY,
            transfer=info.to_dict(),
            routed=c.start.transfer["transfer"],
            samples=10,
        )
        yield c.topics.events(MALLORY), update.encode()


def model_request_flood(c: Context) -> Iterator[tuple[str, bytes]]:
    for _ in range(c.args.requests):
        yield c.topics.events(HONEST), ModelRequest(federation=c.topics.federation, round=0, device=HONEST).encode()


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    messages: Callable[[Context], Iterable[tuple[str, bytes]]] | None
    serving: bool = False  # against a server that exported models and serves them (its own baseline)
    in_cohort: bool = False  # mallory registers first and is sampled with the honest device (cohort of 2)


SCENARIOS = [
    Scenario("baseline", "no flood: one round, then serving", None),
    Scenario("chunks", "(i) chunk frames from a device outside the cohort", chunk_flood),
    Scenario("huge", "(ii) small frames + updates declaring 1 TiB", huge_declaration),
    Scenario("nacks", "(iii) nacks for the whole routed payload", nack_flood),
    Scenario("malformed", "(iv) malformed / deep JSON, register + events", malformed_flood),
    Scenario("messages", "(v) small valid metrics from a registered device", message_flood),
    Scenario(
        "announcements",
        "(vi) a cohort device announcing uploads of its slice, no chunks",
        announcement_flood,
        in_cohort=True,
    ),
    Scenario("baseline-serve", "no flood: round, export, serving", None, serving=True),
    Scenario("models", "model requests for an exported model", model_request_flood, serving=True),
]


# --------------------------------------------------------------------------- one scenario


@dataclasses.dataclass
class Row:
    scenario: Scenario
    sent: tuple[int, int]
    peak_mib: float
    growth_mib: float  # largest VmRSS from the flood's start on, minus VmRSS at its start
    alive: bool
    round: str
    log_lines: int
    dropped: int
    seconds: float
    note: str = ""


def log_lines(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines()) if path.is_file() else 0


def handled(out: Path) -> str:
    """How far the server got through a metrics flood: the last sequence number it recorded for mallory."""
    registry = Registry(out / "devices.sqlite", readonly=True)
    try:
        device = registry.get(MALLORY)
    finally:
        registry.close()
    seq = (device.metrics or {}).get("seq") if device is not None else None
    return "" if seq is None else f"metrics handled up to #{seq + 1:,}"


def settle(path: Path, quiet: float, cap: float) -> None:
    """Wait until the server's log has not grown for ``quiet`` seconds (it digested the flood), at most ``cap``."""
    end = time.monotonic() + cap
    size, since = -1, time.monotonic()
    while time.monotonic() < end:
        now_size = path.stat().st_size if path.is_file() else 0
        if now_size != size:
            size, since = now_size, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.2)


def run(scenario: Scenario, args: argparse.Namespace, work: Path) -> Row:
    work.mkdir(parents=True)
    broker = Broker(work, args.broker_queue)
    topics = Topics(f"flood-{uuid.uuid4().hex[:8]}")
    out = work / "run"
    server_log = work / "server.log"
    command = [
        sys.executable, "-m", "feast_edge.server.cli", "run", "--insecure", "--broker", broker.url, "--out", str(out), "--rounds", "1", "--per-round", "1",
        "--min-clients", "1", "--round-timeout", str(args.round_timeout), "--federation", topics.federation, "--wait-timeout", "120",
        "--threads", "1", "--serve",
    ]  # fmt: skip
    if scenario.in_cohort:
        command[command.index("--per-round") + 1] = "2"
        command += ["--start-clients", "2"]
    if scenario.serving:
        command += [
            "--data",
            str(FASHION_MNIST_DIR),
            "--val-samples",
            "200",
            "--calib-samples",
            "100",
            "--eval-every",
            "1",
        ]
    else:
        command += ["--no-export"]
    processes: list[subprocess.Popen] = []
    attacker = None
    began = time.monotonic()
    try:
        with open(server_log, "w") as log:
            server = subprocess.Popen(
                command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
        processes.append(server)
        rss = PeakRss(server.pid)
        attacker = Attacker(broker.url, topics)
        if scenario.in_cohort:  # once the server listens (a registration before that is lost)
            deadline = time.monotonic() + 120
            while "connected to" not in server_log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            attacker.register()
        with open(work / "agent.log", "w") as log:
            agent = [
                sys.executable, "-m", "feast_edge.agent.cli", "run", "--insecure", "--broker", broker.url, "--device-id", HONEST, "--data", str(FASHION_MNIST_DIR),
                "--shard", args.honest_shard, "--budget", "39M", "--federation", topics.federation, "--threads", "1",
            ]  # fmt: skip
            processes.append(subprocess.Popen(agent, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        start = attacker.next(RoundStart, 120, device=MALLORY if scenario.in_cohort else None)
        if scenario.serving:
            deadline = time.monotonic() + 180
            while "serving model requests" not in server_log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
        context = Context(topics, start, args, attacker)  # type: ignore[arg-type]
        before = log_lines(server_log)
        rss.mark()
        sent = attacker.flood(scenario.messages(context)) if scenario.messages is not None else (0, 0)
        checkpoint = out / CHECKPOINT
        deadline = time.monotonic() + args.round_timeout + 30
        while not checkpoint.is_file() and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.2)
        settle(server_log, quiet=3.0, cap=90.0)
        time.sleep(1.5)  # the next $SYS report
        peak, growth = rss.stop()
        alive = server.poll() is None
        if scenario.serving:
            outcome = "n/a (after the run)"
        elif checkpoint.is_file():
            record = RoundRecord.from_dict(read_record(checkpoint)["fields"]["history"][0])
            outcome = (
                f"yes ({record.seconds:.1f} s)"
                if record.applied and record.updated == [HONEST]
                else f"no ({record.missing or record.rejected})"
            )
        else:
            outcome = "no (no checkpoint)"
        return Row(
            scenario,
            sent,
            peak,
            growth,
            alive,
            outcome,
            log_lines(server_log) - before,
            attacker.dropped,
            time.monotonic() - began,
            handled(out),
        )
    finally:
        if attacker is not None:
            attacker.close()
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        broker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=4000, help="chunk flood: 64 KiB frames")
    parser.add_argument("--nacks", type=int, default=2000, help="nack flood: nacks, each for every chunk")
    parser.add_argument("--malformed", type=int, default=10000, help="malformed flood: messages")
    parser.add_argument("--messages", type=int, default=100_000, help="valid message flood: messages")
    parser.add_argument("--requests", type=int, default=100, help="model-request flood: requests")
    parser.add_argument("--announcements", type=int, default=10_000, help="announcement flood: update announcements")
    parser.add_argument("--round-timeout", type=float, default=60.0)
    parser.add_argument(
        "--honest-shard",
        default="0/200",
        help="the honest device's Fashion-MNIST shard i/N (0/200: 300 examples, ~3 s of training)",
    )
    parser.add_argument("--broker-queue", type=int, default=1000, help="mosquitto max_queued_messages (0: no limit)")
    parser.add_argument("--only", action="append", default=None, help="run only these scenarios (baselines always run)")
    parser.add_argument("--keep", type=Path, default=None, help="work in this directory and keep the logs")
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if args.only is None or s.name in args.only or s.name.startswith("baseline")]
    work = args.keep or Path(tempfile.mkdtemp(prefix="feast-floods-"))
    limit = "no limit" if args.broker_queue == 0 else f"{args.broker_queue}"
    print(
        f"floods against feast-server (fmnist-small, 1 round, honest device 39M MACs), mosquitto max_queued_messages {limit}; "
        f"{os.cpu_count()} CPUs; work dir {work}",
        flush=True,
    )
    rows = []
    for scenario in chosen:
        row = run(scenario, args, work / scenario.name)
        rows.append(row)
        print(
            f"  {scenario.name}: {row.sent[0]} messages, peak RSS {row.peak_mib:.0f} MiB, growth {row.growth_mib:+.0f} MiB, {row.seconds:.0f} s",
            flush=True,
        )
    baselines = {
        False: next((r for r in rows if r.scenario.name == "baseline"), None),
        True: next((r for r in rows if r.scenario.name == "baseline-serve"), None),
    }
    header = (
        "flood",
        "what",
        "messages",
        "MB sent",
        "broker dropped",
        "peak RSS MiB",
        "baseline MiB",
        "ratio",
        "RSS growth MiB",
        "server alive",
        "round completed",
        "log lines",
        "note",
    )
    table = []
    for r in rows:
        base = baselines[r.scenario.serving]
        base_mib = base.peak_mib if base is not None else float("nan")
        table.append(
            (
                r.scenario.name, r.scenario.what, f"{r.sent[0]:,}", f"{r.sent[1] / 1e6:.1f}", f"{r.dropped:,}", f"{r.peak_mib:.0f}", f"{base_mib:.0f}",
                f"{r.peak_mib / base_mib:.2f}", f"{r.growth_mib:+.0f}", "yes" if r.alive else "NO", r.round, f"{r.log_lines:,}", r.note,
            )
        )  # fmt: skip
    widths = [max(len(str(x[i])) for x in [header, *table]) for i in range(len(header))]
    print()
    for line in [header, tuple("-" * w for w in widths), *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
    print(
        "\nbroker dropped: publishes mosquitto dropped at a full subscriber queue (the server's, mostly); RSS growth: the largest VmRSS from "
        "the flood's start on minus VmRSS at its start (the peak RSS of a serving server is set by its export, before any flood); "
        "log lines: lines the server logged from the flood's start to the end of the scenario"
    )


if __name__ == "__main__":
    main()
