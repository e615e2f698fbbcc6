"""Hostile or broken input at the edges of server and agent: the idle limit, devices that decline a round, forged announcements.

Each test asserts the outcome a user relies on: the process keeps running (or
stops with a clear message and its checkpoint), nothing is allocated for what a
stranger declares, the global model is untouched by what was refused.
"""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path

import pytest
import torch

from feast_edge.agent.agent import Agent, AgentConfig
from feast_edge.agent.local_data import LocalClient
from feast_edge.cache.variants import load_cache
from feast_edge.local.recipe import TrainConfig
from feast_edge.protocol import RoundStart
from feast_edge.route.plans import plan_client
from feast_edge.server.app import ServerConfig, ServerError
from feast_edge.sim.shards import read_index
from feast_edge.space.preset import load_preset
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import MiB, TransferInfo
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics

PRESET = load_preset("fmnist-small")


def test_a_server_without_enough_devices_ends_at_its_idle_limit_with_a_clear_message(
    kit, tmp_path: Path, federation: str
) -> None:
    config = ServerConfig.of(
        out=str(tmp_path / "run"), rounds=2, per_round=2, min_clients=2, federation=federation, wait_timeout=2.0
    )
    server = kit.ServerThread(config).start()
    began = time.monotonic()
    try:
        with pytest.raises(ServerError) as caught:
            server.join(60)
    finally:
        server.close()
    assert time.monotonic() - began < 30
    message = str(caught.value)
    assert "only 0 of the 2 devices needed were online after 2 s" in message
    assert "no round was completed" in message and "run the same command again to resume" in message
    assert ServerConfig.of(out="x").network.wait_timeout > 0, "by default a server must not wait forever"


@pytest.mark.slow  # real agent processes
def test_diverging_devices_decline_the_round_and_the_server_stops_waiting_for_them(
    kit, tmp_path: Path, federation: str, partition: Path
) -> None:
    """An absurd learning rate: a device whose training went non-finite says so at once (instead of leaving the round to its
    timeout); one whose weights stayed finite but absurd is refused by the update-norm bound. Neither touches the model."""
    entries = read_index(partition)["clients"][:2]
    config = kit.server_config(
        kit.CONFIG, tmp_path / "run", partition, federation, rounds=1, lr=1e30, round_timeout=300.0, start_clients=2
    )
    server = kit.ServerThread(config).start()
    agents = [kit.spawn_agent(tmp_path / "logs", e["client_id"], partition / e["file"], federation) for e in entries]
    try:
        history = server.join(200)
        before = kit.weights(tmp_path / "run" / "checkpoint.safetensors")
    finally:
        codes = [kit.stop(a) for a in agents]
        server.close()
    record = history[0]
    assert not record.applied and record.updated == []
    assert sorted([*record.rejected, *record.declined]) == sorted(e["client_id"] for e in entries)
    assert record.declined and all(
        "the device sent no update: training diverged" in r for r in record.declined.values()
    )
    assert all("--max-update-norm" in reason for reason in record.rejected.values()), record.rejected
    assert record.seconds < 150, f"the round waited {record.seconds:.0f} s although every device had declined"
    assert codes == [0, 0], [kit.log_text(a)[-600:] for a in agents]
    assert all(
        torch.isfinite(t.float()).all() for t in before.values()
    )  # the global model kept its finite initial weights


def test_a_forged_round_announcing_a_huge_payload_allocates_nothing_and_the_agent_goes_on(federation: str) -> None:
    client = LocalClient(
        "victim",
        torch.zeros(8, 1, 28, 28, dtype=torch.uint8),
        torch.zeros(8, dtype=torch.long),
        None,
        None,
        None,
        "memory",
    )
    agent = Agent(
        AgentConfig(host="victim", federation=federation, budget_macs=6e6),
        LinkConfig(broker="mqtt://127.0.0.1:1883"),
        [client],
    )
    agent.start(timeout=5)
    runner = threading.Thread(target=agent.run, daemon=True)
    runner.start()
    attacker = Link(LinkConfig(broker="mqtt://127.0.0.1:1883"))
    attacker.connect(timeout=5)
    try:
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        huge = 4 * 1024 * MiB
        info = TransferInfo(
            federation=federation,
            round=0,
            device="victim",
            transfer="forged",
            count=huge // MiB,
            size=huge,
            chunk=MiB,
            sha256="0" * 64,
        )
        plan = plan_client(load_cache(PRESET), 6e6)
        forged = RoundStart.from_plan(
            plan,
            federation=federation,
            round=0,
            device="victim",
            instance=agent.instance,  # on a broker without ACLs the registration topic shows it to anyone
            transfer=info,
            sent_at=time.time(),
            timeout=3.0,
            rounds=1,
            lr=0.1,
            seed=1,
            train=TrainConfig(),
        )
        attacker.publish(Topics(federation).ctrl("victim"), forged.encode(), timeout=5)
        frame_flood = [b"\x00" * 64] * 200  # frames of a transfer nobody announced
        attacker.publish_many(Topics(federation).xfer("down", "victim"), frame_flood)
        time.sleep(4)
        assert runner.is_alive(), "the forged round stopped the agent"
        assert (
            agent.clients["victim"].receiver is not None and agent.clients["victim"].receiver.reassembler.active() == []
        )
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before  # KiB
        assert grown < 200 * 1024, f"peak RSS grew by {grown / 1024:.0f} MiB after a forged 4 GiB announcement"
    finally:
        agent.stop.set()
        runner.join(10)
        attacker.close()
        agent.close()


def test_robust_aggregation_is_part_of_the_run_settings_and_checked(tmp_path: Path) -> None:
    assert ServerConfig.of(out=str(tmp_path), aggregation="median").run_concerns().aggregation.rule == "median"
    assert (
        "aggregation" not in ServerConfig.of(out=str(tmp_path)).decisive()
    )  # runs from before the rules existed keep their fingerprint
    assert ServerConfig.of(out=str(tmp_path), aggregation="trimmed-mean", trim=0.2).decisive()["trim"] == 0.2
    with pytest.raises(ServerError, match="unknown; choose one of mean, clip, trimmed-mean, median"):
        ServerConfig.of(out=str(tmp_path), aggregation="krum")


@pytest.mark.slow  # several seconds (processes, a federation or a real simulation): out of the fast loop
def test_floods_from_a_stranger_cost_the_server_no_memory_and_the_round_still_completes(
    kit, tmp_path: Path, federation: str
) -> None:
    """Frames of a transfer nobody announced, one frame declaring 4 GiB, thousands of malformed and deeply nested messages."""
    from test_federation_failures import ScriptedDevice, scripted_server

    from feast_edge.transport.frames import encode_frame

    server = scripted_server(kit, tmp_path, federation, rounds=1)
    attacker = Link(LinkConfig(broker=kit.LOCAL))
    attacker.connect(timeout=5)
    device = ScriptedDevice(federation)
    t = Topics(federation)
    try:
        time.sleep(0.5)
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        size = 64 * MiB
        unannounced = TransferInfo(
            federation=federation,
            round=0,
            device="ghost",
            transfer="flood",
            count=size // 1024,
            size=size,
            chunk=1024,
            sha256="0" * 64,
        )
        attacker.publish_many(
            t.xfer("up", "ghost"), (encode_frame(unannounced, i, b"\x00" * 1024) for i in range(3000)), window=64
        )
        huge = TransferInfo(
            federation=federation,
            round=0,
            device="ghost",
            transfer="huge",
            count=4096,
            size=4096 * MiB,
            chunk=MiB,
            sha256="0" * 64,
        )
        lying = encode_frame(huge, 0, b"\x01" * MiB)[: -MiB + 1]  # a one-byte chunk that declares a 4 GiB transfer
        attacker.publish(t.xfer("up", "ghost"), lying, timeout=5)
        junk = [b"{" * 60_000, b"[" * 30_000 + b"]" * 30_000, b'{"v":1,"kind":"update","round":1e999}', b"\xff" * 1000]
        attacker.publish_many(t.events("ghost"), (junk[i % len(junk)] for i in range(4000)), window=64)
        attacker.publish_many(t.register("ghost"), (junk[i % len(junk)] for i in range(1000)), window=64)
        time.sleep(1.0)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before  # KiB
        assert server.thread.is_alive(), "a flood stopped the server"
        assert grown < 150 * 1024, f"peak RSS grew by {grown / 1024:.0f} MiB under the floods"
        assert server.server.collector is not None and server.server.collector.receiver.reassembler.active() == []
        assert device.register().accepted  # the server still answers
        start, manifest, routed = device.next_round()
        device.send(*device.update(start, routed, manifest))
        history = server.join(60)
    finally:
        device.close()
        attacker.close()
        server.close()
    assert history[0].applied and history[0].updated == [device.device_id]


def test_one_devices_flood_never_crowds_out_another_devices_update(tmp_path: Path, federation: str) -> None:
    """A registered device may flood valid messages on its own topic (ACL and signatures allow it): its metrics wait as
    one message, anything else beyond its share is dropped, and another device's update still gets a place in the queue."""
    from feast_edge.protocol import Metrics, Update
    from feast_edge.server.app import FederationServer
    from feast_edge.server.inbox import PER_DEVICE_QUEUE
    from feast_edge.transport.frames import describe

    server = FederationServer(
        ServerConfig.of(out=str(tmp_path), federation=federation), LinkConfig(broker="mqtt://127.0.0.1:1883")
    )
    try:
        for i in range(10_000):
            server.inbox.put("events", Metrics(federation=federation, round=0, device="flooder", values={"i": i}))
        junk = describe(b"x", federation=federation, round=0, device="flooder").to_dict()
        for _ in range(10_000):
            server.inbox.put(
                "events", Update(federation=federation, round=0, device="flooder", transfer=junk, routed="r", samples=1)
            )
        honest = Update(
            federation=federation,
            round=0,
            device="honest",
            transfer=describe(b"y", federation=federation, round=0, device="honest").to_dict(),
            routed="r",
            samples=5,
        )
        server.inbox.put("events", honest)
        queued = [server.inbox.get(0) for _ in range(server.inbox.qsize())]
        assert len(queued) == PER_DEVICE_QUEUE + 1, len(queued)
        assert queued[-1][1] is honest
        metrics = [m for _, m in queued if isinstance(m, Metrics)]
        assert len(metrics) == 1 and metrics[0].values == {"i": 9999}  # the latest of ten thousand
    finally:
        server.close()


@pytest.mark.slow  # several seconds (processes, a federation or a real simulation): out of the fast loop
def test_model_requests_cost_one_copy_and_one_send_per_interval(tmp_path: Path, federation: str) -> None:
    import hashlib
    import json

    from feast_edge.server.serving import REQUEST_INTERVAL, ModelServer
    from feast_edge.transport.transfer import ChunkSender

    models = tmp_path / "models"
    models.mkdir()
    blob = bytes(range(256)) * 4096  # 1 MiB "model"
    (models / "jet.onnx").write_bytes(blob)
    (models / "jet.json").write_text(json.dumps({"file": "jet.onnx", "sha256": hashlib.sha256(blob).hexdigest()}))
    link = Link(LinkConfig(broker="mqtt://127.0.0.1:1883"))
    link.connect(timeout=5)
    t = Topics(federation)
    sender = ChunkSender(link, t, "down")
    serving = ModelServer(tmp_path, link, t, sender, send_timeout=30)
    try:
        for i in range(50):
            serving.request("jet", f"req{i}")
        assert len(sender.outbox._held) == 1, "fifty requests must not hold fifty copies"
        first = next(iter(sender.outbox._held))
        time.sleep(REQUEST_INTERVAL + 0.2)
        serving.tick()  # the waiting (latest) request is answered once the interval is over, superseding the first copy
        assert len(sender.outbox._held) == 1 and first not in sender.outbox._held
        assert serving._waiting == {}
    finally:
        link.close()


@pytest.mark.slow
def test_a_finished_replayed_from_an_earlier_run_does_not_end_an_agent(
    kit, tmp_path: Path, federation: str, partition: Path
) -> None:
    """Issue 21, item 6: ``finished`` names the agent instance whose registration the server holds; one recorded in
    an earlier run (another instance of the same device) is dropped, and the agent goes on to train this run."""
    from feast_edge.protocol import Finished

    config = ServerConfig.of(
        out=str(tmp_path / "server"),
        preset=kit.CONFIG.preset,
        federation=federation,
        rounds=1,
        per_round=1,
        min_clients=1,
        start_clients=1,
        round_timeout=120.0,
        wait_timeout=120.0,
        batch_size=32,
        data=str(partition),
    )
    attacker = Link(LinkConfig(broker=kit.LOCAL))
    attacker.connect(timeout=5)
    replayed = Finished(
        federation=federation, round=0, device="client-000", rounds=1, completed=1, instance="0123456789abcdef"
    )
    agent = kit.spawn_agent(
        tmp_path / "logs", "client-000", partition / "client-000.safetensors", federation, "--register-timeout", "60"
    )
    try:
        # Before the server exists: the agent waits to register; the replay reaches it first.
        deadline = time.monotonic() + 60
        while "connected to" not in kit.log_text(agent) and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(3):
            attacker.publish(Topics(federation).ctrl("client-000"), replayed.encode(), timeout=5)
        time.sleep(2.0)
        assert agent.poll() is None, kit.log_text(agent)[-2000:]
        server = kit.ServerThread(config).start()
        try:
            history = server.join(180)
            server.server.finish([])  # the real end names the instance that registered: the agent leaves
            assert agent.wait(60) == 0, kit.log_text(agent)[-2000:]
        finally:
            server.close()
        assert history[0].applied and history[0].updated == ["client-000"]
    finally:
        kit.stop(agent)
        attacker.close()
    text = kit.log_text(agent)
    assert "ignored finished for client-000: it names agent instance 0123456789abcdef" in text, text[-3000:]
    assert "federation" in text and "finished after 1 of 1 rounds" in text
