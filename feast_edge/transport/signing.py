"""Signed messages: Ed25519 signatures over every JSON message, for brokers the federation does not control (docs/security.md).

A signed message on the wire is ``MAGIC || signature(64) || body``; the
signature covers ``topic || 0x00 || body``, so a message replayed on another
topic (another device's, another federation's) does not verify. Who must have
signed a message follows from its topic alone: the server signs ``ctrl/{d}``,
``server/status`` and its receipts for uploads (``xfer/nack/up/{d}``); device
``d`` signs everything else it publishes (``status/{d}``, ``register/{d}``,
``events/{d}``, ``xfer/nack/down/{d}``). Chunk frames (``xfer/down``,
``xfer/up``) are not signed: the signed message that announces a transfer
carries its SHA-256, which the receiver checks before using the payload.

Replays of a signed message on its own topic are dropped by message id and
round (``MessageFilter``), both inside the signed body.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from feast_edge.transport.errors import ProtocolError, TopicError, TransportError
from feast_edge.transport.topics import parse_topic

MAGIC = b"FES1"  # feast-edge signed, version 1
SIGNATURE_BYTES = 64
SERVER = "server"  # the name of the server's key in every keyring
_SERVER_CHANNELS = {"ctrl", "server_status"}


class SignatureError(ProtocolError):
    """A message is unsigned, signed by the wrong key, or altered; the receiver drops it."""


class SigningKeyError(TransportError):
    """A signing key file is missing or not an Ed25519 key."""


def signer_of(topic: str) -> str | None:
    """Whose key must have signed a message on ``topic``: ``SERVER``, a device id, or None for chunk frames."""
    try:
        parsed = parse_topic(topic)
    except TopicError as exc:
        raise SignatureError(f"no signer for {topic!r}: {exc}") from None
    if parsed.channel == "xfer":
        return None
    if parsed.channel in _SERVER_CHANNELS or (parsed.channel == "nack" and parsed.direction == "up"):
        return SERVER
    assert parsed.device is not None  # status, register, events and nack/down all name their device
    return parsed.device


def public_key_text(key: Ed25519PublicKey) -> str:
    """The raw 32-byte public key as base64 (how bundles list their peers)."""
    return base64.b64encode(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()


def public_key_from_text(text: str, who: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(
            f"the public key of {who!r} is not a base64 Ed25519 key ({exc}); provision the device again"
        ) from None


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """An Ed25519 private key from a PEM file (as ``feast-server provision`` writes them)."""
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise SigningKeyError(f"signing key {path} does not exist; is the credentials bundle complete?") from None
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"signing key {path} cannot be read: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"signing key {path} is a {type(key).__name__}, not an Ed25519 key")
    return key


def write_private_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write ``key`` as unencrypted PKCS#8 PEM, readable by its owner only."""
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.touch(mode=0o600)
    path.write_bytes(data)


@dataclass
class Keyring:
    """This side's signing key (``identity``) and the public keys of everyone it accepts messages from."""

    identity: str
    private_key: Ed25519PrivateKey
    peers: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.peers = {**self.peers, self.identity: self.private_key.public_key()}  # its own messages come back too

    def seal(self, topic: str, body: bytes) -> bytes:
        """``body`` signed for ``topic``; chunk frames and empty payloads (cleared retained messages) go as they are."""
        if not body or signer_of(topic) is None:
            return body
        return MAGIC + self.private_key.sign(_signed_bytes(topic, body)) + body

    def open(self, topic: str, data: bytes) -> bytes:
        """The body of a signed message on ``topic``, checked against its signer's key; SignatureError otherwise."""
        signer = signer_of(topic)
        if signer is None or not data:
            return data
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + SIGNATURE_BYTES:
            raise SignatureError(f"unsigned message on {topic} (this federation signs every message)")
        key = self.peers.get(signer)
        if key is None:
            raise SignatureError(
                f"message on {topic} is from {signer!r}, whose key this side does not hold (not provisioned)"
            )
        signature, body = data[len(MAGIC) : len(MAGIC) + SIGNATURE_BYTES], data[len(MAGIC) + SIGNATURE_BYTES :]
        try:
            key.verify(signature, _signed_bytes(topic, body))
        except InvalidSignature:
            raise SignatureError(f"message on {topic} does not carry a valid signature of {signer!r}") from None
        return body


def _signed_bytes(topic: str, body: bytes) -> bytes:
    return topic.encode() + b"\x00" + body
