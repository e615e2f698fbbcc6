"""The chunk frame format: a transfer's description and one binary frame per chunk (docs/protocol.md §4).

A payload is cut into ``count`` chunks of ``chunk`` bytes (the last one
shorter). Each chunk travels as one binary frame::

    [4-byte big-endian header length][compact JSON header][chunk bytes]

The header names the federation, round, device and transfer, the chunk's
index, the chunk count, the payload size, the nominal chunk size and the
SHA-256 of the *whole* payload (:class:`TransferInfo`). Reassembly and resends
are ``chunks.py``; nothing here touches MQTT.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from feast_edge.transport.errors import ChunkError, TopicError
from feast_edge.transport.topics import validate_id

MiB = 1024 * 1024
DEFAULT_CHUNK_SIZE = MiB
MAX_CHUNK_SIZE = 16 * MiB  # hard ceiling for a configured chunk size
MIN_CHUNK_SIZE = (
    1024  # the smallest chunk the applications send or take (tiny chunks would multiply per-chunk bookkeeping)
)
MAX_HEADER_BYTES = 4096
_LENGTH = struct.Struct(">I")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_INFO_FIELDS = ("federation", "round", "device", "transfer", "count", "size", "chunk", "sha256")


def new_transfer_id() -> str:
    """A fresh random transfer id (32 hex characters)."""
    return uuid.uuid4().hex


def chunk_count(size: int, chunk: int) -> int:
    """Number of chunks of a ``size``-byte payload; an empty payload still travels as one empty chunk."""
    return max(1, -(-size // chunk))


def validate_chunk_size(chunk_size: int, limit: int = MAX_CHUNK_SIZE) -> int:
    """Return ``chunk_size`` if it is an integer in [1, limit], else raise ValueError."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= limit:
        raise ValueError(f"chunk size must be an integer between 1 and {limit} bytes, got {chunk_size!r}")
    return chunk_size


def _field_error(name: str, value: Any, want: str) -> ChunkError:
    return ChunkError(f"chunk header field {name!r} must be {want}, got {str(value)[:80]!r}")


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _field_error(name, value, "a non-negative integer")
    return value


@dataclass(frozen=True)
class TransferInfo:
    """What every chunk of one transfer says about the whole payload."""

    federation: str
    round: int
    device: str
    transfer: str
    count: int
    size: int
    chunk: int
    sha256: str

    def __post_init__(self) -> None:
        try:
            for name in ("federation", "device", "transfer"):
                validate_id(getattr(self, name), f"{name} id")
        except TopicError as exc:
            raise ChunkError(f"chunk header: {exc}") from None
        for name in ("round", "count", "size", "chunk"):
            _nonneg_int(name, getattr(self, name))
        if self.chunk < 1:
            raise _field_error("chunk", self.chunk, "at least 1")
        if self.count != chunk_count(self.size, self.chunk):
            raise ChunkError(
                f"chunk header: count {self.count} does not match size {self.size} in chunks of {self.chunk} "
                f"(expected {chunk_count(self.size, self.chunk)})"
            )
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise _field_error("sha256", self.sha256, "64 lowercase hex digits")

    def chunk_length(self, index: int) -> int:
        """Byte length of chunk ``index``."""
        return max(0, min(self.chunk, self.size - index * self.chunk))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TransferInfo:
        """Validate an untrusted mapping (a frame header or a control message field); ChunkError if malformed."""
        if not isinstance(data, dict):
            raise ChunkError(f"transfer description must be a JSON object, got {type(data).__name__}")
        missing = [name for name in _INFO_FIELDS if name not in data]
        if missing:
            raise ChunkError(f"transfer description lacks {', '.join(missing)}")
        return cls(**{name: data[name] for name in _INFO_FIELDS})


def describe(
    payload: bytes | bytearray | memoryview,
    *,
    federation: str,
    round: int,
    device: str,
    transfer: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TransferInfo:
    """Hash ``payload`` and describe its transfer in chunks of ``chunk_size`` bytes."""
    validate_chunk_size(chunk_size)
    size = memoryview(payload).nbytes
    return TransferInfo(
        federation=federation,
        round=round,
        device=device,
        transfer=transfer or new_transfer_id(),
        count=chunk_count(size, chunk_size),
        size=size,
        chunk=chunk_size,
        sha256=hashlib.sha256(payload).hexdigest(),
    )


def _header_bytes(info: TransferInfo, index: int) -> bytes:
    header = {**info.to_dict(), "index": index}
    return json.dumps(header, separators=(",", ":")).encode()


def encode_frame(info: TransferInfo, index: int, data: bytes | memoryview) -> bytes:
    """One chunk frame: header length, compact JSON header, chunk bytes (the only copy of the data)."""
    if not 0 <= index < info.count:
        raise ValueError(f"chunk index {index} is outside 0..{info.count - 1}")
    if len(data) != info.chunk_length(index):
        raise ValueError(f"chunk {index} has {len(data)} bytes, expected {info.chunk_length(index)}")
    header = _header_bytes(info, index)
    return b"".join((_LENGTH.pack(len(header)), header, data))


def iter_frames(
    info: TransferInfo, payload: bytes | bytearray | memoryview, indices: Iterable[int] | None = None
) -> Iterator[bytes]:
    """Frames of ``payload`` for ``indices`` (all chunks by default), built lazily one at a time."""
    view = memoryview(payload).cast("B")
    if view.nbytes != info.size:
        raise ValueError(f"payload has {view.nbytes} bytes but transfer {info.transfer} describes {info.size}")
    for index in range(info.count) if indices is None else indices:
        start = index * info.chunk
        yield encode_frame(info, index, view[start : start + info.chunk_length(index)])


def decode_frame(frame: bytes | bytearray | memoryview) -> tuple[TransferInfo, int, memoryview]:
    """Split a frame into (transfer info, chunk index, chunk bytes without copying); ChunkError if malformed."""
    view = memoryview(frame).cast("B")
    if view.nbytes < _LENGTH.size:
        raise ChunkError(f"chunk frame of {view.nbytes} bytes is shorter than its 4-byte length prefix")
    (length,) = _LENGTH.unpack_from(view)
    if length > MAX_HEADER_BYTES:
        raise ChunkError(f"chunk header claims {length} bytes; the limit is {MAX_HEADER_BYTES}")
    end = _LENGTH.size + length
    if end > view.nbytes:
        raise ChunkError(f"chunk header claims {length} bytes but the frame holds only {view.nbytes - _LENGTH.size}")
    try:
        header = json.loads(bytes(view[_LENGTH.size : end]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ChunkError(f"chunk header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or "index" not in header:
        raise ChunkError("chunk header must be a JSON object with an 'index'")
    index = _nonneg_int("index", header.pop("index"))
    info = TransferInfo.from_dict(header)
    if index >= info.count:
        raise ChunkError(f"chunk index {index} is outside 0..{info.count - 1} of transfer {info.transfer}")
    data = view[end:]
    if data.nbytes != info.chunk_length(index):
        raise ChunkError(
            f"chunk {index} of transfer {info.transfer} carries {data.nbytes} bytes, expected {info.chunk_length(index)}"
        )
    return info, index, data
