"""One client an agent hosts: its data and budget, its transfers to and from the server, what it did."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from feast_edge.agent.downloads import Downloads
from feast_edge.agent.local_data import LocalClient
from feast_edge.transport.chunks import Reassembler
from feast_edge.transport.frames import MIN_CHUNK_SIZE
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender


@dataclass
class Hosted:
    """A hosted (virtual) client: one device id with its own data, budget and transfer topics."""

    data: LocalClient
    budget_macs: int
    receiver: ChunkReceiver  # what the server sends it (paho's thread expects announced transfers on it)
    downloads: Downloads  # the agent thread's waits for those transfers
    sender: ChunkSender  # its uploads
    rounds_trained: int = 0
    model_path: Path | None = None
    # Its folder read again with more training images than the server registered: trained on once the server accepts
    # the registration of its counts (an update may not claim more samples than registered); feast_edge.agent.growth.
    staged: LocalClient | None = None
    accepted_at: int | None = None  # the inbox number of the server's answer that accepted the staged data's counts

    @property
    def current(self) -> LocalClient:
        """The newest data read: the staged data, else the data it trains on."""
        return self.data if self.staged is None else self.staged

    def settle(self, number: int) -> bool:
        """Before a round or request that arrived as inbox message ``number``: train on the staged data if the server
        accepted its counts before that message came (one sent before may expect the counts registered before)."""
        if self.staged is None or self.accepted_at is None or number < self.accepted_at:
            return False
        self.data, self.staged, self.accepted_at = self.staged, None, None
        return True

    @classmethod
    def on(
        cls, link: Link, topics: Topics, data: LocalClient, budget_macs: int, *, chunk_size: int, max_payload: int
    ) -> Hosted:
        """``data``'s client with its transfer topics on ``link`` (subscribed when the link connects)."""
        # Only transfers the server announced to this device, each at most the largest payload it can be sent.
        reassembler = Reassembler(
            federation=topics.federation,
            max_chunk_size=chunk_size,
            min_chunk_size=MIN_CHUNK_SIZE,
            max_payload_bytes=max_payload,
            max_buffered_bytes=2 * max_payload,
            expected_only=True,
            refetch=1,  # a payload that fails its hash (a corrupted chunk) is fetched once more before the round is declined
        )
        receiver = ChunkReceiver(link, topics, "down", device=data.device_id, reassembler=reassembler)
        sender = ChunkSender(link, topics, "up", device=data.device_id, chunk_size=chunk_size)
        return cls(data, budget_macs, receiver, Downloads(receiver), sender)

    @property
    def device_id(self) -> str:
        return self.data.device_id
