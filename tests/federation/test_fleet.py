"""Many devices on one server: one agent process hosting 60 virtual clients, and uploads that await receipts without blocking.

The scaling measurements (50-400 devices) are ``bench/bench_fleet.py``; these tests prove the behaviour it relies on.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from feast_edge.server.app import REGISTRY, FederationServer, ServerConfig
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import describe
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender, Confirmations

CLIENTS = 60
BROKER = "mqtt://127.0.0.1:1883"  # the tests' broker (tests/federation/conftest.py)


@pytest.mark.slow  # a feast-agent process, every round
def test_sixty_virtual_clients_in_one_agent_complete_every_round(
    kit, federation: str, fashion_mnist_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = ServerConfig.of(
        out=str(out),
        rounds=2,
        per_round=CLIENTS,
        min_clients=CLIENTS,
        round_timeout=120.0,
        wait_timeout=120.0,
        federation=federation,
        batch_size=8,
        epochs=1,
        seed=0,
    )
    server = kit.ServerThread(config).start()
    # Shard 0 of 125 holds 480 examples: 8 for each of the 60 clients, every one at the cache's smallest variant.
    agent = kit.spawn_agent(
        tmp_path / "logs",
        "fleet",
        fashion_mnist_dir,
        federation,
        "--clients",
        str(CLIENTS),
        "--shard",
        "0/125",
        "--budget",
        "1.5M",
    )
    try:
        history = server.join(150)
    finally:
        server.close()
        kit.stop(agent)
    devices = [f"fleet-{i}" for i in range(CLIENTS)]
    for record in history:
        assert record.applied and sorted(record.updated) == sorted(devices), (
            record.round,
            record.rejected,
            record.missing,
            kit.log_text(agent)[-2000:],
        )
        assert not record.rejected and not record.missing and not record.dropped
    with sqlite3.connect(out / REGISTRY) as db:
        rows = db.execute("SELECT device_id, rounds FROM devices").fetchall()
    assert sorted(rows) == sorted((d, 2) for d in devices)  # each registered once under its own id, in both aggregates
    text = kit.log_text(agent)
    assert text.count("sent its update") == 2 * CLIENTS
    assert "no receipt" not in text  # every upload's receipt came while the agent went on with its next client


def test_the_server_takes_an_upload_from_every_cohort_device_at_once(federation: str, tmp_path: Path) -> None:
    # Hundreds of devices finishing together upload together: a fixed cap (32) on transfers in progress refused the rest.
    server = FederationServer(
        ServerConfig.of(out=str(tmp_path / "run"), per_round=100, min_clients=2, federation=federation),
        LinkConfig(broker=BROKER),
    )
    server.start(timeout=5)
    try:
        assert server.collector is not None
        uploads = server.collector.receiver.reassembler
        for i in range(100):
            uploads.expect(describe(b"update", federation=federation, round=0, device=f"d{i}", chunk_size=4096))
        assert len(uploads.active()) == 100
    finally:
        server.close()


def _pair(federation: str) -> tuple[list[Link], Topics, ChunkSender, list[str]]:
    """Connected links: one with an upload sender for device ``d``, one that counts the frames the broker carries on its upload topic."""
    topics = Topics(federation)
    link, observer = Link(LinkConfig(broker=BROKER)), Link(LinkConfig(broker=BROKER))
    frames: list[str] = []
    lock = threading.Lock()

    def seen(received) -> None:
        with lock:
            frames.append(received.topic)

    observer.subscribe(topics.xfer("up", "d"), seen)
    observer.connect(timeout=5)
    sender = ChunkSender(link, topics, "up", device="d", chunk_size=4096)
    link.connect(timeout=5)
    return [link, observer], topics, sender, frames


def _send(sender: ChunkSender, topics: Topics) -> object:
    payload = bytes(range(256)) * 40  # 3 chunks of 4096 bytes
    info = sender.describe(payload, round=0, device="d")
    sender.announce_and_send(topics.events("d"), b"{}", payload, info, timeout=10)
    return info


def _check_until(confirmations: Confirmations, seconds: float, **kwargs) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        confirmations.check(**kwargs)
        time.sleep(0.02)


def test_confirmations_send_again_without_a_receipt_at_most_attempts_minus_one_times(federation: str) -> None:
    links, topics, sender, frames = _pair(federation)
    try:
        info = _send(sender, topics)
        confirmations = Confirmations(receipt_wait=0.3, attempts=3)
        confirmations.add("d", sender, topics.events("d"), b"{}", info, until=time.monotonic() + 60)
        _check_until(confirmations, 1.5)
        assert len(frames) == 3 * info.count  # sent once, then twice again; never a fourth time
        assert len(confirmations) == 0
    finally:
        for link in links:
            link.close()


def test_confirmations_forget_a_receipted_transfer_and_a_cancelled_owner(federation: str) -> None:
    links, topics, sender, frames = _pair(federation)
    receiver = ChunkReceiver(links[0], topics, "up", device="d")
    try:
        confirmations = Confirmations(receipt_wait=0.3, attempts=3)
        info = _send(sender, topics)
        confirmations.add("d", sender, topics.events("d"), b"{}", info, until=time.monotonic() + 60)
        assert receiver.get(timeout=5) is not None and sender.wait_receipt(info.transfer, 5) is not None
        _check_until(confirmations, 0.8)
        assert len(confirmations) == 0 and len(frames) == info.count  # no resend: the receipt came

        receiver.reassembler.advance(1)  # round 0 is over for the receiver: its chunks get no receipt now
        late = _send(sender, topics)
        confirmations.add("d", sender, topics.events("d"), b"{}", late, until=time.monotonic() + 60)
        _check_until(confirmations, 0.8, cancelled=lambda owner: owner == "d")
        assert (
            len(confirmations) == 0 and len(frames) == info.count + late.count
        )  # cancelled (a newer round came): not sent again
    finally:
        for link in links:
            link.close()
