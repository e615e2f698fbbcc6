"""What goes wrong in a real deployment, against real brokers and processes; each test is bounded in time.

Misbehaving devices are scripted with the transport itself (``feast_edge.transport``) so
they can send what a real agent never sends: duplicate and stale updates,
corrupted chunks, tensors that do not match the routed envelope, garbage.
Vanishing devices, server restarts and refused agents use the real
``feast-agent`` / ``feast-server`` processes.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import logging
import pickle
import queue
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as safetensors_save

from feast_edge.aggregate.robust import aggregate_updates
from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.protocol import Register, Registered, RoundStart, Update
from feast_edge.route.payload import Manifest, decode, encode
from feast_edge.route.plans import plan_client
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT
from feast_edge.server.app import ServerConfig
from feast_edge.sim.shards import read_index
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import describe, encode_frame
from feast_edge.transport.link import Link
from feast_edge.transport.messages import Presence, parse
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender

PRESET = load_preset("fmnist-small")


def scripted_server(kit, out: Path, fed: str, rounds: int, **changes: object):
    """A server that trains with one device per round and needs one valid update to aggregate (``changes``: other settings)."""
    settings = dict(per_round=1, min_clients=1, round_timeout=20.0, seed=0, batch_size=32, wait_timeout=30.0)
    config = ServerConfig.of(out=str(out), rounds=rounds, federation=fed, **{**settings, **changes})  # type: ignore[arg-type]
    return kit.ServerThread(config).start()


class ScriptedDevice:
    """A device driven by the test through feast_edge.transport: registers, receives its routed payload, sends whatever it is told."""

    def __init__(self, fed: str, device_id: str = "scripted-1") -> None:
        self.fed, self.device_id = fed, device_id
        self.topics = Topics(fed)
        self.instance = uuid.uuid4().hex[:16]
        self.link = Link(
            LinkConfig(broker="mqtt://127.0.0.1:1883"),
            presence=Presence(federation=fed, round=0, device=device_id, state="online"),
        )
        self.ctrl: queue.Queue = queue.Queue()
        self.link.subscribe(self.topics.ctrl(device_id), lambda r: self.ctrl.put(parse(r.payload)))
        self.link.connect(timeout=5)
        self.receiver = ChunkReceiver(self.link, self.topics, "down", device=device_id)
        self.sender = ChunkSender(self.link, self.topics, "up", device=device_id, chunk_size=64 * 1024)

    def close(self) -> None:
        self.link.close()

    def _next(self, kind: type, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.ctrl.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout} s")

    def register(self, budget: int = 6_000_000, samples: int = 50, digest: str = PRESET.digest) -> Registered:
        message = Register(
            federation=self.fed,
            round=0,
            device=self.device_id,
            host=self.device_id,
            instance=self.instance,
            preset=PRESET.name,
            preset_digest=digest,
            budget_macs=budget,
            samples=samples,
            profile={"name": "scripted"},
        )
        self.link.publish(self.topics.register(message.device), message.encode(), timeout=5)
        return self._next(Registered)

    def next_round(self) -> tuple[RoundStart, Manifest, dict[str, torch.Tensor]]:
        start = self._next(RoundStart)
        progress = self.receiver.get(timeout=30)
        assert progress is not None and progress.info.transfer == start.transfer["transfer"]
        manifest, state = decode(progress.payload, PRESET)
        return start, manifest, state

    def update(
        self,
        start: RoundStart,
        state: dict[str, torch.Tensor],
        manifest: Manifest,
        *,
        round: int | None = None,
        samples: int = 50,
        as_given: bool = False,
    ) -> tuple[Update, bytes]:
        """An update message and its payload, not yet sent (``as_given``: the tensors' own dtypes, as a sender ignoring the manifest writes them)."""
        t = start.round if round is None else round
        manifest = dataclasses.replace(manifest, kind="update", round=t)
        if as_given:
            blob = safetensors_save(
                {k: v.contiguous() for k, v in state.items()},
                metadata={"feast_edge": json.dumps(manifest.to_dict(), sort_keys=True)},
            )
        else:
            blob = encode(state, manifest)
        info = describe(blob, federation=self.fed, round=t, device=self.device_id, chunk_size=64 * 1024)
        message = Update(
            federation=self.fed,
            round=t,
            device=self.device_id,
            transfer=info.to_dict(),
            routed=start.transfer["transfer"],
            samples=samples,
            metrics={"loss": 1.0},
        )
        return message, blob

    def send(self, message: Update, blob: bytes | None, *, raw: bytes | None = None) -> None:
        self.link.publish(self.topics.events(self.device_id), raw or message.encode(), timeout=5)
        if blob is not None:
            self.sender.send(
                blob, round=message.round, device=self.device_id, transfer=message.transfer["transfer"], timeout=30
            )


def shifted(state: dict[str, torch.Tensor], delta: float) -> dict[str, torch.Tensor]:
    return {k: v + delta if v.is_floating_point() else v.clone() for k, v in state.items()}


@pytest.fixture
def device(federation: str) -> Iterator[ScriptedDevice]:
    d = ScriptedDevice(federation)
    yield d
    d.close()


# --------------------------------------------------------------------------- scripted misbehaviour


def test_duplicate_and_stale_updates_are_ignored(kit, tmp_path: Path, federation: str, device: ScriptedDevice) -> None:
    server = scripted_server(kit, tmp_path, federation, rounds=2)
    try:
        assert device.register().accepted
        expected = Supernet(PRESET, seed=0).state_dict()
        # Round 0: one valid update, the same message again (same msg_id), and a second update for the round.
        start, manifest, routed = device.next_round()
        first, blob = device.update(start, shifted(routed, 0.5), manifest)
        second, other = device.update(start, shifted(routed, 2.0), manifest)
        device.link.publish(device.topics.events(device.device_id), first.encode(), timeout=5)
        device.send(first, None, raw=first.encode())
        device.send(second, other)
        device.sender.send(blob, round=0, device=device.device_id, transfer=first.transfer["transfer"], timeout=30)
        expected = aggregate_updates(expected, [(device.device_id, shifted(routed, 0.5), 50)])
        # Round 1: a late update for round 0 first (stale), then the real one.
        start1, manifest1, routed1 = device.next_round()
        stale, stale_blob = device.update(start, shifted(routed, 3.0), manifest)
        device.send(stale, stale_blob)
        update, blob1 = device.update(start1, shifted(routed1, 0.25), manifest1)
        device.send(update, blob1)
        expected = aggregate_updates(expected, [(device.device_id, shifted(routed1, 0.25), 50)])
        history = server.join(timeout=60)
    finally:
        server.close()
    assert [h.updated for h in history] == [[device.device_id], [device.device_id]] and all(h.applied for h in history)
    assert any("duplicate message id" in r for r in history[0].ignored), history[0].ignored
    assert any("duplicate for round 1 (the first one counts)" in r for r in history[0].ignored), history[0].ignored
    assert any("stale: round 1 < current round 2" in r for r in history[1].ignored), history[1].ignored
    got = kit.weights(tmp_path / CHECKPOINT)
    assert all(torch.equal(got[k], expected[k]) for k in got), "a duplicate or stale update entered the aggregate"


def test_a_corrupted_chunk_is_rejected_and_the_model_untouched(
    kit, tmp_path: Path, federation: str, device: ScriptedDevice
) -> None:
    server = scripted_server(kit, tmp_path, federation, rounds=1)
    try:
        device.register()
        start, manifest, routed = device.next_round()
        update, blob = device.update(start, shifted(routed, 1.0), manifest)
        info = describe(
            blob,
            federation=federation,
            round=0,
            device=device.device_id,
            transfer=update.transfer["transfer"],
            chunk_size=64 * 1024,
        )
        assert info.count >= 2
        device.link.publish(device.topics.events(device.device_id), update.encode(), timeout=5)
        for i in range(info.count):
            data = bytearray(blob[i * info.chunk : (i + 1) * info.chunk])
            if i == 1:
                data[7] ^= 0xFF  # one flipped byte: the whole-payload SHA-256 no longer matches
            device.link.publish(
                device.topics.xfer("up", device.device_id), encode_frame(info, i, bytes(data)), timeout=5
            )
        receipt = device.sender.wait_receipt(info.transfer, timeout=30)
        history = server.join(timeout=60)
    finally:
        server.close()
    assert receipt is not None and not receipt.ok and "sha256 mismatch" in receipt.reason
    assert (
        "sha256 mismatch" in history[0].rejected[device.device_id] and not history[0].applied and not history[0].updated
    )
    initial = Supernet(PRESET, seed=0).state_dict()
    got = kit.weights(tmp_path / CHECKPOINT)
    assert all(torch.equal(got[k], initial[k]) for k in got)


def test_payloads_that_do_not_match_the_routed_envelope_are_rejected(
    kit, tmp_path: Path, federation: str, device: ScriptedDevice
) -> None:
    server = scripted_server(kit, tmp_path, federation, rounds=3)
    cache_plan = plan_client(server.server.cache, 1e12)  # every cached variant: the widest envelope
    try:
        device.register()
        # Round 0: the routed envelope's manifest, but one tensor has another shape.
        start, manifest, routed = device.next_round()
        bad = shifted(routed, 1.0)
        # A BN weight 8 entries longer: the upload stays within the routed size, so the decoder sees the shape.
        name = min(k for k, v in bad.items() if v.dim() == 1 and k.endswith(".weight"))
        bad[name] = torch.zeros(bad[name].shape[0] + 8)
        device.send(*device.update(start, bad, manifest))
        # Round 1: tensors and manifest of a wider envelope than the one routed.
        start, manifest, routed = device.next_round()
        wider = Supernet(PRESET, layout=cache_plan.layout(PRESET, PRESET.classes), seed=1).state_dict()
        device.send(*device.update(start, wider, dataclasses.replace(manifest, envelope=cache_plan.envelope)))
        # Round 2: one routed tensor left out.
        start, manifest, routed = device.next_round()
        partial = shifted(routed, 1.0)
        partial.pop(next(iter(partial)))
        device.send(*device.update(start, partial, manifest))
        history = server.join(timeout=90)
    finally:
        server.close()
    reasons = [h.rejected.get(device.device_id, "") for h in history]
    assert f"payload tensor {name} has shape" in reasons[0], reasons
    assert "the slice routed to it encodes to at most" in reasons[1], (
        reasons
    )  # refused from its announcement, before any chunk is kept
    assert "1 missing" in reasons[2], reasons
    assert not any(h.applied for h in history)
    initial = Supernet(PRESET, seed=0).state_dict()
    got = kit.weights(tmp_path / CHECKPOINT)
    assert all(torch.equal(got[k], initial[k]) for k in got), "a refused payload changed the global model"


def test_poisoned_and_hostile_updates_are_refused_and_the_server_goes_on(
    kit, tmp_path: Path, federation: str, device: ScriptedDevice
) -> None:
    """Weights outside 1..registered samples, a finite but absurd update, a header nested 100k deep, NaN, another dtype, a pickle:
    refused; then an honest update counts."""
    server = scripted_server(kit, tmp_path, federation, rounds=8)
    expected = Supernet(PRESET, seed=0).state_dict()
    try:
        device.register(samples=50)
        start, manifest, routed = device.next_round()
        device.send(*device.update(start, shifted(routed, 0.1), manifest, samples=0))
        start, manifest, routed = device.next_round()
        device.send(*device.update(start, shifted(routed, 0.1), manifest, samples=2**53))
        start, manifest, routed = device.next_round()
        device.send(*device.update(start, shifted(routed, 1e30), manifest))
        start, manifest, routed = device.next_round()
        deep = b"[" * 100_000 + b"]" * 100_000
        evil = len(deep).to_bytes(8, "little") + deep
        info = describe(evil, federation=federation, round=start.round, device=device.device_id, chunk_size=64 * 1024)
        device.send(
            Update(
                federation=federation,
                round=start.round,
                device=device.device_id,
                transfer=info.to_dict(),
                routed=start.transfer["transfer"],
                samples=50,
            ),
            evil,
        )
        start, manifest, routed = device.next_round()
        nan = shifted(routed, 0.1)
        nan[next(k for k, v in nan.items() if v.is_floating_point())].view(-1)[0] = float("nan")
        device.send(*device.update(start, nan, manifest))
        start, manifest, routed = device.next_round()
        doubled = {k: v.double() if v.is_floating_point() else v for k, v in routed.items()}
        half = {
            k: v.half() if v.is_floating_point() else v for k, v in routed.items()
        }  # same names, a smaller upload: the decoder sees the dtype
        device.send(*device.update(start, half, manifest, as_given=True))
        start, manifest, routed = device.next_round()
        pickled = pickle.dumps(
            dict(list(doubled.items())[:4])
        )  # what torch.save would send, within the routed size: never unpickled
        info = describe(
            pickled, federation=federation, round=start.round, device=device.device_id, chunk_size=64 * 1024
        )
        device.send(
            Update(
                federation=federation,
                round=start.round,
                device=device.device_id,
                transfer=info.to_dict(),
                routed=start.transfer["transfer"],
                samples=50,
            ),
            pickled,
        )
        start, manifest, routed = device.next_round()
        device.send(*device.update(start, shifted(routed, 0.25), manifest))
        expected = aggregate_updates(expected, [(device.device_id, shifted(routed, 0.25), 50)])
        history = server.join(timeout=150)
    finally:
        server.close()
    reasons = [h.rejected.get(device.device_id, "") for h in history]
    assert "claims 0 samples" in reasons[0] and "claims 9007199254740992 samples" in reasons[1], reasons
    assert "changes the routed slice by" in reasons[2] and "--max-update-norm" in reasons[2], reasons
    assert "not a feast-edge manifest" in reasons[3], reasons
    assert "holds NaN or infinite values" in reasons[4], reasons
    assert "has dtype torch.float16, expected torch.float32" in reasons[5], reasons
    assert "not safetensors" in reasons[6], reasons
    assert [h.applied for h in history] == [False] * 7 + [True]
    got = kit.weights(tmp_path / CHECKPOINT)
    assert all(torch.equal(got[k], expected[k]) for k in got), "a refused update reached the global model"


def test_malformed_messages_are_logged_and_never_stop_the_server(
    kit, tmp_path: Path, federation: str, device: ScriptedDevice, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    server = scripted_server(kit, tmp_path, federation, rounds=1)
    t = device.topics
    try:
        junk = [
            (t.register("ghost"), b"garbage"),
            (t.register("ghost"), b'{"v":1,"kind":"register"}'),
            (t.events("ghost"), b"\xff\xfe\x00"),
            (t.events("ghost"), b"[1,2,3]"),
            (t.status("ghost"), b"{not json"),
            (t.xfer("up", "ghost"), b"\x00\x00\x00\x05short"),
            (t.xfer("up", device.device_id), b""),
            (t.nack("down", "ghost"), b'{"v":1}'),
            (f"feast/{federation}/no/such/topic", b"x"),
        ]
        for topic, payload in junk:
            device.link.publish(topic, payload, timeout=5)
        # A well-formed message on the wrong topic and a registration naming another device than its topic.
        device.link.publish(
            t.events("ghost"),
            Presence(federation=federation, round=0, device="ghost", state="online").encode(),
            timeout=5,
        )
        refused = {
            "preset": device.register(digest="0" * 64),
            "budget": device.register(budget=1000),
            "samples": device.register(samples=0),
        }
        assert device.register().accepted
        start, manifest, routed = device.next_round()
        device.send(*device.update(start, routed, manifest))
        history = server.join(timeout=60)
    finally:
        server.close()
    assert history[0].applied and history[0].updated == [device.device_id]
    assert not any(r.accepted for r in refused.values())
    assert "preset mismatch" in refused["preset"].reason and "--preset fmnist-small" in refused["preset"].reason
    assert "below the smallest cached variant" in refused["budget"].reason
    assert "no training examples" in refused["samples"].reason
    logged = caplog.text
    assert logged.count("dropped malformed message") >= 5 and "does not belong on the events topic" in logged


# --------------------------------------------------------------------------- real agent processes


@pytest.mark.slow  # real agent processes
def test_a_device_vanishing_mid_round_never_blocks_it(kit, tmp_path: Path, federation: str, partition: Path) -> None:
    entries = read_index(partition)["clients"][:2]
    config = ServerConfig.of(
        out=str(tmp_path / "run"),
        preset=kit.CONFIG.preset,
        rounds=1,
        per_round=3,
        min_clients=2,
        start_clients=3,
        round_timeout=120.0,
        seed=0,
        batch_size=32,
        federation=federation,
        wait_timeout=120.0,
    )
    server = kit.ServerThread(config).start()
    agents = [kit.spawn_agent(tmp_path, e["client_id"], partition / e["file"], federation) for e in entries]
    # The victim trains a large shard (6,000 images) on fmnist-tiny's largest variant, so it is still training when
    # it is killed.
    victim = kit.spawn_agent(
        tmp_path,
        "victim",
        FASHION_MNIST_DIR,
        federation,
        "--shard",
        "0/10",
        "--budget",
        "1.5M",
        "--preset",
        "fmnist-tiny",
    )
    try:
        assert kit.wait_for(lambda: "victim trains" in kit.log_text(victim), timeout=150), kit.log_text(victim)
        victim.kill()  # no clean DISCONNECT: the broker publishes its last will
        victim.wait(10)
        history = server.join(timeout=150)
    finally:
        codes = [kit.stop(a) for a in agents]
        kit.stop(victim)
        server.close()
    record = history[0]
    assert record.cohort == sorted([e["client_id"] for e in entries] + ["victim"])
    # Dropped, not missing: the round stopped waiting for the victim when its last will arrived, not at the deadline.
    assert record.dropped == ["victim"] and not record.missing
    assert record.updated == [e["client_id"] for e in entries] and record.applied
    assert codes == [0, 0]


@pytest.mark.slow  # real agent processes
def test_server_restart_resumes_at_the_last_checkpoint_without_repeating_a_round(
    kit, tmp_path: Path, federation: str, partition: Path
) -> None:
    config = kit.CONFIG.changed(rounds=3)
    expected = kit.simulated_weights(config, tmp_path / "simulation")
    out = tmp_path / "run"
    command = kit.server_command(config, out, federation, partition, no_export=True)
    first = kit.spawn(command, tmp_path / "server-first.log")
    # One agent hosts two virtual clients of the partition, another the third client's shard file.
    host = kit.spawn_agent(tmp_path, "lab-host", partition, federation, "--clients", "2")
    single = kit.spawn_agent(tmp_path, "client-002", partition / "client-002.safetensors", federation)
    try:
        checkpoint = out / CHECKPOINT
        done = lambda: checkpoint.is_file() and read_record(checkpoint)["fields"]["round"] >= 1  # noqa: E731
        assert kit.wait_for(done, timeout=240, interval=0.02), f"no checkpoint after round 1: {kit.log_text(host)}"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = read_record(checkpoint)["fields"]["round"]
        assert killed_at < 3, "the server finished before it could be killed mid-federation"
        second = subprocess.run(command, cwd=kit.REPO, capture_output=True, text=True, timeout=300)
    finally:
        codes = [kit.stop(host), kit.stop(single)]
        if first.poll() is None:
            first.kill()
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming from {checkpoint}: {killed_at} of 3 rounds completed" in " ".join(second.stderr.split())
    fields = read_record(checkpoint)["fields"]
    assert fields["round"] == 3 and [h["round"] for h in fields["history"]] == [1, 2, 3]
    diff = kit.max_abs_diff(kit.weights(checkpoint), expected)
    assert diff <= 1e-6, f"the resumed federation differs from the uninterrupted simulation by {diff}"
    assert codes == [0, 0]


@pytest.mark.slow  # real agent processes
def test_a_second_agent_with_an_online_device_id_is_refused(
    kit, tmp_path: Path, federation: str, partition: Path
) -> None:
    config = ServerConfig.of(
        out=str(tmp_path / "run"),
        preset=kit.CONFIG.preset,
        rounds=1,
        per_round=5,
        min_clients=5,
        federation=federation,
        wait_timeout=240.0,
    )
    server = kit.ServerThread(config).start()  # waits for 5 devices: it only handles registrations here
    shard = partition / "client-000.safetensors"
    first = kit.spawn_agent(tmp_path / "a", "twin", shard, federation)
    third = None
    try:
        assert kit.wait_for(lambda: "registered twin with federation" in kit.log_text(first), timeout=120), (
            kit.log_text(first)
        )
        second = subprocess.run(
            kit.agent_command("twin", shard, federation, "--register-timeout", "60"),
            cwd=kit.REPO,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert lines[-1].startswith("error: the server refused device twin: device id 'twin' is already online"), (
            second.stderr
        )
        assert "Traceback" not in second.stderr
        time.sleep(1.0)
        assert "twin" in server.server.online_devices(), "the refused agent took the first one offline"
        assert kit.stop(first) == 0
        assert kit.wait_for(lambda: "twin" not in server.server.online_devices(), timeout=10)
        # Once the first agent has left, the id is free again (e.g. the device restarted).
        third = kit.spawn_agent(tmp_path / "c", "twin", shard, federation)
        assert kit.wait_for(lambda: "registered twin with federation" in kit.log_text(third), timeout=120), (
            kit.log_text(third)
        )
        assert kit.stop(third) == 0
    finally:
        for process in (first, third):
            if process is not None:
                kit.stop(process)  # also when an assertion failed: no agent outlives its test
        server.close()


# --------------------------------------------------------------------------- command-line errors


def _one_line_error(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], result.stderr


@pytest.fixture(scope="module")
def password_broker(kit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private mosquitto on a free loopback port that requires a user name and password."""
    d = tmp_path_factory.mktemp("mosquitto")
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(d / "passwd"), "alice", "s3cret"],
        check=True,
        capture_output=True,
        timeout=10,
    )
    port = kit.free_port()
    (d / "mosquitto.conf").write_text(
        f"user {getpass.getuser()}\npersistence false\nlog_dest stderr\nlistener {port} 127.0.0.1\nallow_anonymous false\npassword_file {d / 'passwd'}\n"
    )
    log = open(d / "mosquitto.log", "w")
    process = subprocess.Popen(["mosquitto", "-c", str(d / "mosquitto.conf")], stdout=log, stderr=subprocess.STDOUT)
    try:
        if not kit.wait_for(lambda: kit.port_open(port), timeout=5):
            pytest.fail(f"private mosquitto did not start: {(d / 'mosquitto.log').read_text()}")
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def test_unreachable_broker_is_one_line_for_both_commands(
    server_cli, agent_cli, kit, tmp_path: Path, partition: Path
) -> None:
    nowhere = f"mqtt://127.0.0.1:{kit.free_port()}"
    server = server_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        nowhere,
        "--out",
        str(tmp_path / "run"),
        "--rounds",
        "1",
        "--per-round",
        "1",
        "--min-clients",
        "1",
    )
    _one_line_error(server, "cannot reach MQTT broker at 127.0.0.1:")
    agent = agent_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        nowhere,
        "--device-id",
        "d1",
        "--data",
        str(partition / "client-000.safetensors"),
    )
    _one_line_error(agent, "connection refused; is the broker running? check --broker")
    fetch = agent_cli.invoke("fetch-model", "--broker", nowhere, "--device-id", "d1", "--out", str(tmp_path / "m.onnx"))
    _one_line_error(fetch, "cannot reach MQTT broker")


def test_without_credentials_both_commands_refuse_unless_insecure(
    server_cli, agent_cli, kit, tmp_path: Path, partition: Path
) -> None:
    """Issue 21, item 5: no bundle, no --insecure: one line naming what a stranger could do and the two fixes."""
    server = server_cli.invoke("run", "--broker", kit.LOCAL, "--out", str(tmp_path / "run"), "--rounds", "1")
    _one_line_error(
        server, "feast-server run without --credentials is unauthenticated: anyone who can reach the broker"
    )
    assert "give --credentials BUNDLE" in server.stderr and "--insecure" in server.stderr
    agent = agent_cli.invoke(
        "run", "--broker", kit.LOCAL, "--device-id", "d1", "--data", str(partition / "client-000.safetensors")
    )
    _one_line_error(agent, "feast-agent run without --credentials is unauthenticated")
    nowhere = f"mqtt://127.0.0.1:{kit.free_port()}"
    insecure = agent_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        nowhere,
        "--device-id",
        "d1",
        "--data",
        str(partition / "client-000.safetensors"),
    )
    assert (
        "--insecure: no credentials, no signatures: anyone who can reach the broker"
        in insecure.stderr + insecure.stdout
    )


def test_wrong_credentials_are_one_line_for_both_commands(
    server_cli, agent_cli, tmp_path: Path, partition: Path, password_broker: str
) -> None:
    creds = ["--username", "alice", "--password", "wrong"]
    server = server_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        password_broker,
        *creds,
        "--out",
        str(tmp_path / "run"),
        "--rounds",
        "1",
        "--per-round",
        "1",
        "--min-clients",
        "1",
    )
    _one_line_error(server, "rejected the credentials of user 'alice'")
    agent = agent_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        password_broker,
        *creds,
        "--device-id",
        "d1",
        "--data",
        str(partition / "client-000.safetensors"),
    )
    _one_line_error(agent, "check --username/--password")


def test_agent_input_errors_are_one_line(agent_cli, kit, tmp_path: Path, partition: Path, federation: str) -> None:
    missing = agent_cli.invoke("run", "--broker", kit.LOCAL, "--device-id", "d1", "--data", str(tmp_path / "nowhere"))
    _one_line_error(missing, "does not exist; pass a Fashion-MNIST directory")
    low = agent_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        kit.LOCAL,
        "--device-id",
        "d1",
        "--data",
        str(partition / "client-000.safetensors"),
        "--budget",
        "100K",
    )
    _one_line_error(low, "below the smallest cached variant")
    silent = agent_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        kit.LOCAL,
        "--device-id",
        "d1",
        "--data",
        str(partition / "client-000.safetensors"),
        "--federation",
        federation,
        "--register-timeout",
        "1",
    )
    _one_line_error(
        silent, f"no feast-server answered the registration of d1 within 1 s: the server of federation '{federation}'"
    )
    fetch = agent_cli.invoke(
        "fetch-model",
        "--broker",
        kit.LOCAL,
        "--device-id",
        "d1",
        "--out",
        str(tmp_path / "m.onnx"),
        "--federation",
        federation,
        "--timeout",
        "1",
    )
    _one_line_error(fetch, "no feast-server answered the model request of d1")
