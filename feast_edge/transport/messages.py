"""JSON control messages: small validated dataclasses, one ``parse`` for the wire (docs/protocol.md §3).

Every message carries ``federation``, ``round``, ``device`` and a unique
``msg_id``; ``parse`` turns untrusted bytes into one of the registered kinds or
raises ProtocolError, whatever the bytes are. ``MessageFilter`` then drops
duplicates and stale messages so that handlers only see each message once.

This module defines the transport's own kinds (presence, nack, receipt);
FEAST's round protocol registers its kinds in ``feast_edge.protocol``.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import typing
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.topics import MAX_ID_LENGTH, validate_id

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
MAX_NACK_INDICES = 4096
MAX_INT = 2**53  # JSON numbers stay exact below this in every implementation

_COMMON = ("federation", "round", "device", "msg_id")
_KINDS: dict[str, type[Message]] = {}

M = TypeVar("M", bound="type[Message]")


def new_msg_id() -> str:
    """A fresh random message id (32 hex characters)."""
    return uuid.uuid4().hex


def message_kind(name: str) -> Callable[[M], M]:
    """Class decorator registering a Message subclass under the wire ``kind`` ``name``."""

    def register(cls: M) -> M:
        if name in _KINDS:
            raise ValueError(f"message kind {name!r} is already registered by {_KINDS[name].__name__}")
        cls.kind = name
        _KINDS[name] = cls
        return cls

    return register


def known_kinds() -> list[str]:
    """Names of every registered message kind."""
    return sorted(_KINDS)


def _check_value(name: str, value: Any, annotation: Any) -> Any:
    """Check one field against its annotation; return it normalized (lists become tuples)."""
    if annotation is str:
        if not isinstance(value, str):
            raise ProtocolError(f"field {name!r} must be a string, got {type(value).__name__}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"field {name!r} must be true or false, got {type(value).__name__}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"field {name!r} must be an integer, got {type(value).__name__}")
        if not 0 <= value <= MAX_INT:
            raise ProtocolError(f"field {name!r} must be in [0, 2^53], got {value}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ProtocolError(f"field {name!r} must be a finite number, got {value!r}")
        return float(value)
    if typing.get_origin(annotation) is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"field {name!r} must be a JSON object, got {type(value).__name__}")
        return value
    if typing.get_origin(annotation) is tuple:
        item = (typing.get_args(annotation) or (int,))[0]
        if not isinstance(value, (list, tuple)):
            what = "integers" if item is int else "strings"
            raise ProtocolError(f"field {name!r} must be a list of {what}, got {type(value).__name__}")
        return tuple(_check_value(f"{name}[{i}]", v, item) for i, v in enumerate(value))
    raise TypeError(f"unsupported message field type {annotation!r} for {name!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True, kw_only=True)
class Message:
    """Fields every message carries; subclasses add their own and register a ``kind``."""

    kind: ClassVar[str] = ""
    round_scoped: ClassVar[bool] = True  # stale when its round is older than the receiver's
    deduplicated: ClassVar[bool] = True  # dropped when its msg_id was seen before

    federation: str
    round: int
    device: str
    msg_id: str = field(default_factory=new_msg_id)

    def __post_init__(self) -> None:
        hints = _field_types(type(self))
        for f in fields(self):
            value = _check_value(f.name, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        try:
            validate_id(self.federation, "federation id")
            validate_id(self.device, "device id")
            validate_id(self.msg_id, "message id")
        except TopicError as exc:
            raise ProtocolError(str(exc)) from None
        self.check()

    def check(self) -> None:
        """Kind-specific validation beyond field types; raise ProtocolError."""

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        for name, value in body.items():
            if isinstance(value, tuple):
                body[name] = list(value)
        return {"v": PROTOCOL_VERSION, "kind": self.kind, **body}

    def encode(self) -> bytes:
        """Compact UTF-8 JSON, as sent on the wire."""
        try:
            data = json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{self.kind} message is not JSON-serializable: {exc}") from None
        if len(data) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"{self.kind} message is {len(data)} bytes; the limit is {MAX_MESSAGE_BYTES}")
        return data


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ProtocolError(f"field {name!r} must be one of {', '.join(choices)}, got {value!r}")


def check_transfer(value: dict[str, Any]) -> TransferInfo:
    """The transfer a message describes; ChunkError (a ProtocolError) when malformed."""
    return TransferInfo.from_dict(value)


def check_ids(message: Message, *names: str) -> None:
    """Each named field of ``message`` must be a valid id (ProtocolError otherwise)."""
    for name in names:
        try:
            validate_id(getattr(message, name), f"{name} id")
        except TopicError as exc:
            raise ProtocolError(str(exc)) from None


# --- transport kinds --------------------------------------------------------------------------


@message_kind("presence")
@dataclass(frozen=True, kw_only=True)
class Presence(Message):
    """Retained online/offline state of a device or the server; also the last will."""

    round_scoped: ClassVar[bool] = False
    deduplicated: ClassVar[bool] = False  # a last will is fixed at connect time and may repeat

    state: str
    role: str = "device"

    def check(self) -> None:
        check_choice("state", self.state, ("online", "offline"))
        check_choice("role", self.role, ("device", "server"))


@message_kind("nack")
@dataclass(frozen=True, kw_only=True)
class Nack(Message):
    """Receiver -> sender: resend these chunk indices of a transfer."""

    transfer: str
    missing: tuple[int, ...]

    def check(self) -> None:
        validate_transfer_id(self.transfer)
        if not self.missing:
            raise ProtocolError("a nack must list at least one missing chunk index")
        if len(self.missing) > MAX_NACK_INDICES:
            raise ProtocolError(f"a nack lists {len(self.missing)} indices; the limit is {MAX_NACK_INDICES}")


@message_kind("receipt")
@dataclass(frozen=True, kw_only=True)
class Receipt(Message):
    """Receiver -> sender: a transfer completed (``ok``) or was rejected (``reason``); the sender may drop it."""

    transfer: str
    ok: bool
    reason: str = ""

    def check(self) -> None:
        validate_transfer_id(self.transfer)


def validate_transfer_id(value: str) -> str:
    """Return ``value`` if it is a valid transfer id, else raise ProtocolError."""
    try:
        return validate_id(value, "transfer id")
    except TopicError as exc:
        raise ProtocolError(str(exc)) from None


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"JSON constant {name} is not allowed")


def parse(data: bytes | bytearray, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one control message from the wire; ProtocolError for anything malformed, never another exception."""
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError(f"a message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        obj = json.loads(bytes(data).decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"message is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"message is not valid JSON: {exc.msg} at char {exc.pos}") from None
    except RecursionError:
        raise ProtocolError("message JSON is nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(obj).__name__}")
    version = obj.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"message protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    kind = obj.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(
            f"unknown message kind {str(kind)[:MAX_ID_LENGTH]!r}; known kinds: {', '.join(known_kinds())}"
        )
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(obj) - names)
    if unknown:
        raise ProtocolError(f"{kind} message has unknown fields {', '.join(u[:MAX_ID_LENGTH] for u in unknown[:5])}")
    missing = [name for name in _COMMON if name not in obj]
    if missing:
        raise ProtocolError(f"{kind} message lacks {', '.join(missing)}")
    try:
        return cls(**obj)
    except TypeError as exc:  # a required kind-specific field is absent
        raise ProtocolError(f"{kind} message: {exc}") from None


class MessageFilter:
    """Drops messages of another federation, duplicates (same msg_id) and stale ones (round older than current)."""

    def __init__(self, federation: str, current_round: int = 0, memory: int = 4096) -> None:
        self.federation = validate_id(federation, "federation id")
        self.current_round = current_round
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._memory = memory
        self._lock = threading.Lock()

    def advance(self, round_id: int) -> None:
        """Move to ``round_id``; messages of earlier rounds become stale. Never moves backwards."""
        with self._lock:
            self.current_round = max(self.current_round, round_id)

    def verdict(self, message: Message) -> str | None:
        """The reason to drop ``message``, or None when it is new and current (then it is remembered)."""
        if message.federation != self.federation:
            return f"federation {message.federation!r} is not {self.federation!r}"
        with self._lock:
            if message.round_scoped and message.round < self.current_round:
                return f"stale: round {message.round + 1} < current round {self.current_round + 1}"  # 1-based, as people read rounds
            if message.deduplicated:
                if message.msg_id in self._seen:
                    return f"duplicate message id {message.msg_id}"
                self._seen[message.msg_id] = None
                if len(self._seen) > self._memory:
                    self._seen.popitem(last=False)
        return None

    def accept(self, message: Message) -> bool:
        """True when ``message`` should be handled (see ``verdict``)."""
        return self.verdict(message) is None
