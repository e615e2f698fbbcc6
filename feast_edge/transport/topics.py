"""Topic names of one federation: the only place that builds or parses them (docs/protocol.md §2).

Every topic lives under ``feast/{federation}/``, and every topic a device
publishes on names that device, so a broker ACL can pin each identity to its
own topics (``feast-server provision`` writes one)::

    status/{device}            retained device presence; the device's last will
    server/status              retained server presence; the server's last will
    register/{device}          device -> server registration requests
    ctrl/{device}              server -> one device control messages (JSON)
    events/{device}            device -> server events: updates, metrics, model requests (JSON)
    xfer/down/{device}         server -> device chunk frames of large payloads
    xfer/up/{device}           device -> server chunk frames of large payloads
    xfer/nack/down/{device}    device -> server: missing-chunk requests and receipts for xfer/down
    xfer/nack/up/{device}      server -> device: missing-chunk requests and receipts for xfer/up
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from feast_edge.transport.errors import TopicError

PREFIX = "feast"
MAX_ID_LENGTH = 64
WILDCARD = "+"
DIRECTIONS = ("down", "up")

Direction = Literal["down", "up"]

_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]+")
_MQTT_SPECIAL = {"/": "a topic level separator", "+": "a single-level wildcard", "#": "a multi-level wildcard"}


def validate_id(value: object, what: str = "id") -> str:
    """Return ``value`` if it is a usable federation/device/transfer id, else raise TopicError saying why."""
    if not isinstance(value, str):
        raise TopicError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise TopicError(f"{what} is empty; use 1-{MAX_ID_LENGTH} characters from A-Z a-z 0-9 . _ -")
    if len(value) > MAX_ID_LENGTH:
        raise TopicError(f"{what} {value[:20]!r}... is {len(value)} characters long; the limit is {MAX_ID_LENGTH}")
    for char, role in _MQTT_SPECIAL.items():
        if char in value:
            raise TopicError(
                f"{what} {value!r} contains {char!r}, which MQTT uses as {role}; use only A-Z a-z 0-9 . _ -"
            )
    if not _ID_PATTERN.fullmatch(value):
        bad = sorted({c for c in value if not _ID_PATTERN.fullmatch(c)})
        raise TopicError(f"{what} {value!r} contains {''.join(bad)!r}; use only A-Z a-z 0-9 . _ -")
    return value


def validate_direction(direction: str) -> Direction:
    """Return ``direction`` if it is 'down' (server -> device) or 'up' (device -> server)."""
    if direction not in DIRECTIONS:
        raise TopicError(f"transfer direction must be 'down' or 'up', got {direction!r}")
    return direction  # type: ignore[return-value]


def _device_or_wildcard(device: str) -> str:
    return device if device == WILDCARD else validate_id(device, "device id")


@dataclass(frozen=True)
class Topic:
    """A parsed federation topic: its channel and, where the channel has them, device and direction."""

    federation: str
    channel: str  # status | server_status | register | ctrl | events | xfer | nack
    device: str | None = None
    direction: Direction | None = None


@dataclass(frozen=True)
class Topics:
    """Topic builder for one federation; ``device='+'`` gives the subscription filter over all devices."""

    federation: str

    def __post_init__(self) -> None:
        validate_id(self.federation, "federation id")

    @property
    def root(self) -> str:
        return f"{PREFIX}/{self.federation}"

    @property
    def all(self) -> str:
        """Filter matching every topic of this federation."""
        return f"{self.root}/#"

    def status(self, device: str) -> str:
        return f"{self.root}/status/{_device_or_wildcard(device)}"

    @property
    def server_status(self) -> str:
        return f"{self.root}/server/status"

    def register(self, device: str) -> str:
        return f"{self.root}/register/{_device_or_wildcard(device)}"

    def ctrl(self, device: str) -> str:
        return f"{self.root}/ctrl/{_device_or_wildcard(device)}"

    def events(self, device: str) -> str:
        return f"{self.root}/events/{_device_or_wildcard(device)}"

    def xfer(self, direction: str, device: str) -> str:
        """Chunk frames of payloads travelling ``direction`` to or from ``device``."""
        return f"{self.root}/xfer/{validate_direction(direction)}/{_device_or_wildcard(device)}"

    def nack(self, direction: str, device: str) -> str:
        """Receiver feedback (missing-chunk requests, receipts) for transfers travelling ``direction``."""
        return f"{self.root}/xfer/nack/{validate_direction(direction)}/{_device_or_wildcard(device)}"

    def parse(self, topic: str) -> Topic:
        """Parse a topic of this federation; TopicError for anything else."""
        parsed = parse_topic(topic)
        if parsed.federation != self.federation:
            raise TopicError(f"topic {topic!r} belongs to federation {parsed.federation!r}, not {self.federation!r}")
        return parsed


def parse_topic(topic: str) -> Topic:
    """Parse any federation topic into its parts; TopicError if it is not one this protocol defines."""
    parts = topic.split("/")
    if len(parts) < 3 or parts[0] != PREFIX:
        raise TopicError(f"topic {topic!r} is not a feast topic ({PREFIX}/{{federation}}/...)")
    federation = validate_id(parts[1], "federation id")
    rest = parts[2:]
    match rest:
        case ["status", device]:
            return Topic(federation, "status", validate_id(device, "device id"))
        case ["server", "status"]:
            return Topic(federation, "server_status")
        case ["register", device]:
            return Topic(federation, "register", validate_id(device, "device id"))
        case ["ctrl", device]:
            return Topic(federation, "ctrl", validate_id(device, "device id"))
        case ["events", device]:
            return Topic(federation, "events", validate_id(device, "device id"))
        case ["xfer", "nack", direction, device]:
            return Topic(federation, "nack", validate_id(device, "device id"), validate_direction(direction))
        case ["xfer", direction, device]:
            return Topic(federation, "xfer", validate_id(device, "device id"), validate_direction(direction))
    raise TopicError(f"topic {topic!r} is not one of the federation topics (see docs/protocol.md)")
