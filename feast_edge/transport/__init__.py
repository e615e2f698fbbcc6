"""feast_edge.transport: the MQTT transport shared by feast-server and feast-agent (docs/protocol.md).

Topics of a federation, validated JSON control messages, chunked transfer of
large payloads with SHA-256 verification and nacks, and a paho-mqtt 2 link with
presence, TLS, credentials and reconnects. The method itself (feast_edge) knows
nothing about this package.
"""

from feast_edge.transport.chunks import (
    DEFAULT_CHUNK_SIZE,
    Outbox,
    Progress,
    Reassembler,
    Status,
    TransferInfo,
    decode_frame,
    describe,
    encode_frame,
    iter_frames,
)
from feast_edge.transport.errors import (
    BrokerAuthError,
    BrokerTlsError,
    BrokerUnreachableError,
    ChunkError,
    LinkError,
    ProtocolError,
    TopicError,
    TransportError,
)
from feast_edge.transport.link import BrokerAddress, Link, LinkConfig, Received, parse_broker_url
from feast_edge.transport.messages import (
    Message,
    MessageFilter,
    Metrics,
    ModelReady,
    ModelRequest,
    Nack,
    Presence,
    Receipt,
    Register,
    Registered,
    RoundStart,
    Update,
    message_kind,
    parse,
)
from feast_edge.transport.topics import Topic, Topics, parse_topic, validate_id
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "BrokerAddress",
    "BrokerAuthError",
    "BrokerTlsError",
    "BrokerUnreachableError",
    "ChunkError",
    "ChunkReceiver",
    "ChunkSender",
    "Link",
    "LinkConfig",
    "LinkError",
    "Message",
    "MessageFilter",
    "Metrics",
    "ModelReady",
    "ModelRequest",
    "Nack",
    "Outbox",
    "Presence",
    "Progress",
    "ProtocolError",
    "Reassembler",
    "Receipt",
    "Received",
    "Register",
    "Registered",
    "RoundStart",
    "Status",
    "Topic",
    "TopicError",
    "Topics",
    "TransferInfo",
    "TransportError",
    "Update",
    "decode_frame",
    "describe",
    "encode_frame",
    "iter_frames",
    "message_kind",
    "parse",
    "parse_broker_url",
    "parse_topic",
    "validate_id",
]
