"""A device whose routed payload arrives corrupted asks for it again and trains that round (issue 21, item 4).

Between one ``feast-agent run`` and the real Mosquitto sits a TCP proxy that reads the MQTT packets the broker sends
the agent and flips one bit in the first chunk of the first downlink transfer. The agent's SHA-256 check fails, it
nacks every chunk once, the server sends them again, and the round ends with every cohort device's update
aggregated: the same weights as the in-process simulation of the same population.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from feast_edge.run.loop import CHECKPOINT
from feast_edge.sim.shards import read_index

pytestmark = [pytest.mark.broker]

PUBLISH = 3


class BitFlipProxy:
    """127.0.0.1:``port`` -> the broker; flips one bit in the first PUBLISH (broker -> client) whose topic holds ``needle``."""

    def __init__(self, upstream: int, needle: bytes) -> None:
        self.upstream, self.needle = upstream, needle
        self.flipped = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for s in self._sockets:
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            broker = socket.create_connection(("127.0.0.1", self.upstream))
            self._sockets += [client, broker]
            threading.Thread(target=self._copy, args=(client, broker), daemon=True).start()
            threading.Thread(target=self._packets, args=(broker, client), daemon=True).start()

    @staticmethod
    def _copy(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    @staticmethod
    def _read(source: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = source.recv(n - len(data))
            if not part:
                raise OSError("closed")
            data += part
        return data

    def _packets(self, source: socket.socket, sink: socket.socket) -> None:
        """Broker -> client, packet by packet (fixed header, remaining length, body)."""
        try:
            while True:
                first = self._read(source, 1)
                length, shift, header = 0, 0, first
                while True:
                    byte = self._read(source, 1)
                    header += byte
                    length |= (byte[0] & 0x7F) << shift
                    shift += 7
                    if not byte[0] & 0x80:
                        break
                body = bytearray(self._read(source, length))
                if first[0] >> 4 == PUBLISH and not self.flipped.is_set() and length > 2:
                    topic = bytes(body[2 : 2 + int.from_bytes(body[:2], "big")])
                    if self.needle in topic:
                        body[-1] ^= 0x01  # the payload's last byte: chunk data, never the frame's header
                        self.flipped.set()
                sink.sendall(header + bytes(body))
        except OSError:
            pass


@pytest.mark.slow  # a federation of real agent processes (make test-fast leaves it out)
def test_one_flipped_bit_in_a_downlink_chunk_is_fetched_again_and_the_device_trains_that_round(
    kit, partition: Path, tmp_path: Path
) -> None:
    fed = kit.new_federation()
    out = tmp_path / "federation"
    entries = read_index(partition)["clients"]
    victim = entries[0]["client_id"]
    proxy = BitFlipProxy(1883, f"/xfer/down/{victim}".encode())
    agents = []
    try:
        server = kit.ServerThread(kit.server_config(kit.CONFIG, out, partition, fed)).start()
        try:
            for entry in entries:
                broker = f"mqtt://127.0.0.1:{proxy.port}" if entry["client_id"] == victim else kit.LOCAL
                agents.append(
                    kit.spawn_agent(out / "logs", entry["client_id"], partition / entry["file"], fed, broker=broker)
                )
            history = server.join(timeout=300)
        finally:
            codes = [kit.stop(p) for p in agents]
            server.close()
    finally:
        proxy.close()
    assert proxy.flipped.is_set(), "the proxy saw no downlink chunk for the device"
    assert all(code == 0 for code in codes), codes
    log = kit.log_text(agents[0])
    assert "sha256 mismatch; asking for every chunk again (1 of 1)" in log, log[-2000:]
    assert [h.updated == h.cohort and h.applied for h in history] == [True, True]
    assert any(victim in h.updated for h in history)
    simulated = kit.simulated_weights(kit.CONFIG, tmp_path / "simulation")
    got = kit.weights(out / CHECKPOINT)
    assert all(k in simulated and (got[k] == simulated[k]).all() for k in got), (
        f"differs by {kit.max_abs_diff(got, simulated)}"
    )
