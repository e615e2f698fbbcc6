"""Chunked transfer of large binary payloads: reassembly and resends (docs/protocol.md §4).

Frames are described in ``frames.py``. The ``Reassembler`` (receiver) accepts
chunks in any order and any number of times, keeps memory bounded, verifies
the hash on completion and lists missing indices for a nack; the ``Outbox``
(sender) keeps each payload until it is acknowledged or expires, so that
nacked chunks can be sent again. Nothing here touches MQTT.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from feast_edge.transport.errors import ChunkError
from feast_edge.transport.frames import (
    DEFAULT_CHUNK_SIZE,
    MiB,
    TransferInfo,
    decode_frame,
    describe,
    iter_frames,
    validate_chunk_size,
)

Clock = Callable[[], float]


SHA_MISMATCH = "sha256 mismatch"


class Status(enum.Enum):
    """What adding one chunk did."""

    PARTIAL = "partial"  # new chunk stored, transfer incomplete
    DUPLICATE = "duplicate"  # chunk already held; ignored
    COMPLETE = "complete"  # last chunk arrived and the SHA-256 matched: payload ready
    REJECTED = "rejected"  # last chunk arrived but the SHA-256 did not match: transfer dropped
    FINISHED = "finished"  # chunk of a transfer that already completed, was rejected or expired; ignored
    STALE = "stale"  # chunk of a round older than the receiver's min_round; ignored
    UNEXPECTED = (
        "unexpected"  # chunk of a transfer nobody announced, on a receiver that takes only expected ones; ignored
    )


@dataclass(frozen=True)
class Progress:
    """Result of ``Reassembler.add``: the transfer, the chunk's index, the status and, when complete, the payload."""

    info: TransferInfo
    index: int
    status: Status
    payload: bytes | None = None
    reason: str = ""

    @property
    def corrupt(self) -> bool:
        """Every chunk arrived but the payload's SHA-256 did not match (the sender's fault, or the link's)."""
        return self.status is Status.REJECTED and self.reason.startswith(SHA_MISMATCH)


@dataclass
class _Incoming:
    info: TransferInfo
    started: float
    last_activity: float
    last_nack: float = float("-inf")
    parts: dict[int, memoryview] = field(default_factory=dict)
    hasher: Any = field(default_factory=hashlib.sha256)
    hashed: int = 0  # chunks 0..hashed-1 are in the hasher already
    refetched: int = 0  # times every chunk was asked for again after the payload failed its hash

    def store(self, index: int, data: memoryview) -> None:
        self.parts[index] = data
        # Hash in index order as chunks arrive, so completion only has to hash the tail.
        while self.hashed in self.parts:
            self.hasher.update(self.parts[self.hashed])
            self.hashed += 1

    def missing(self, limit: int | None = None) -> list[int]:
        """The first ``limit`` missing indices (all when None): work and memory follow what a nack can carry, not the declared count."""
        gaps = (i for i in range(self.info.count) if i not in self.parts)
        return list(gaps) if limit is None else list(itertools.islice(gaps, limit))


class Reassembler:
    """Receiver side: rebuilds payloads from chunk frames with bounded memory (thread-safe)."""

    def __init__(
        self,
        *,
        federation: str | None = None,
        max_transfers: int = 32,
        max_payload_bytes: int = 1024 * MiB,
        max_buffered_bytes: int = 2048 * MiB,
        max_chunk_size: int = DEFAULT_CHUNK_SIZE,
        min_chunk_size: int = 1,
        expected_only: bool = False,
        ttl: float = 120.0,
        remember: int = 1024,
        clock: Clock = time.monotonic,
        refetch: int = 0,
    ) -> None:
        """Limits on what a sender may declare; ``expected_only``: chunks of transfers not announced with :meth:`expect` are ignored
        without allocating anything (a stranger's frames cost the receiver nothing). ``refetch``: times a transfer whose
        payload fails its SHA-256 is started over (every chunk nacked again, which the sender still holds: no receipt
        was sent) before it is rejected; a corrupted chunk cannot be told from a good one, so all are asked for."""
        self.refetch = refetch
        self.federation = federation
        self.max_transfers = max_transfers
        self.max_payload_bytes = max_payload_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.max_chunk_size = max_chunk_size
        self.min_chunk_size = min_chunk_size
        self.expected_only = expected_only
        self.ttl = ttl
        self.min_round = 0  # chunks of earlier rounds are stale; raise it with advance()
        self._remember = remember
        self._clock = clock
        self._active: dict[str, _Incoming] = {}
        self._finished: OrderedDict[str, tuple[Status, str]] = OrderedDict()
        self._lock = threading.Lock()

    def add(
        self, frame: bytes | bytearray | memoryview, now: float | None = None, *, device: str | None = None
    ) -> Progress:
        """Take one chunk frame; ChunkError when it is malformed, foreign, over a limit or contradicts its transfer.

        ``device``, when given, is the device the frame's topic names; a header naming another device is refused.
        """
        info, index, data = decode_frame(frame)
        if device is not None and info.device != device:
            raise ChunkError(f"chunk of device {info.device!r} arrived on the topic of device {device!r}")
        now = self._clock() if now is None else now
        with self._lock:
            if info.round < self.min_round:
                return Progress(
                    info, index, Status.STALE, reason=f"round {info.round} < current round {self.min_round}"
                )
            finished = self._finished.get(info.transfer)
            if finished is not None:
                return Progress(info, index, Status.FINISHED, reason=finished[1])
            if self.expected_only and info.transfer not in self._active:
                return Progress(info, index, Status.UNEXPECTED, reason="no announcement named this transfer")
            incoming = self._open(info, now)
            if index in incoming.parts:
                return Progress(info, index, Status.DUPLICATE)
            incoming.store(index, data)
            incoming.last_activity = now
            if len(incoming.parts) < info.count:
                return Progress(info, index, Status.PARTIAL)
            del self._active[info.transfer]
            # The hash was updated chunk by chunk, so the verdict is cheap; record it before releasing the lock.
            digest = incoming.hasher.hexdigest()
            if digest != info.sha256 and incoming.refetched < self.refetch:
                again = self._active[info.transfer] = _Incoming(info, incoming.started, now)
                again.refetched = incoming.refetched + 1
                again.last_nack = float("-inf")  # nacked at the next poll: every chunk
                reason = f"sha256 mismatch; asking for every chunk again ({again.refetched} of {self.refetch})"
                return Progress(info, index, Status.PARTIAL, reason=reason)
            if digest != info.sha256:
                reason = f"{SHA_MISMATCH}: received payload hashes to {digest}, header says {info.sha256}"
                self._finish(info.transfer, Status.REJECTED, reason)
                return Progress(info, index, Status.REJECTED, reason=reason)
            self._finish(info.transfer, Status.COMPLETE, "")
        payload = b"".join(incoming.parts[i] for i in range(info.count))
        return Progress(info, index, Status.COMPLETE, payload=payload)

    def advance(self, round_id: int) -> list[TransferInfo]:
        """Make rounds before ``round_id`` stale: later chunks of them are ignored and their transfers dropped."""
        with self._lock:
            self.min_round = max(self.min_round, round_id)
            stale = [t for t, incoming in self._active.items() if incoming.info.round < self.min_round]
            dropped = []
            for transfer in stale:
                dropped.append(self._active.pop(transfer).info)
                self._finish(transfer, Status.REJECTED, f"round ended (now round {self.min_round})")
            return dropped

    def expect(self, info: TransferInfo, now: float | None = None) -> None:
        """Announce a transfer before its chunks arrive, so ``missing``/``stalled`` cover chunks that never came."""
        with self._lock:
            if info.transfer not in self._finished:
                self._open(info, self._clock() if now is None else now)

    def missing(self, transfer: str, limit: int | None = None) -> list[int]:
        """Indices of the chunks of ``transfer`` not yet received, the first ``limit`` of them (empty when unknown or finished)."""
        with self._lock:
            incoming = self._active.get(transfer)
            return incoming.missing(limit) if incoming else []

    def received(self, transfer: str) -> int | None:
        """How many distinct chunks of the active ``transfer`` are in (None when it is not in progress): a progress figure."""
        with self._lock:
            incoming = self._active.get(transfer)
            return None if incoming is None else len(incoming.parts)

    def active(self) -> list[TransferInfo]:
        """Transfers in progress."""
        with self._lock:
            return [incoming.info for incoming in self._active.values()]

    def outcome(self, transfer: str) -> tuple[Status, str] | None:
        """(COMPLETE or REJECTED, reason) for a recently finished transfer, else None."""
        with self._lock:
            return self._finished.get(transfer)

    def stalled(
        self, idle: float, now: float | None = None, limit: int | None = None
    ) -> list[tuple[TransferInfo, list[int]]]:
        """Transfers with no new chunk and no nack for ``idle`` seconds, with (the first ``limit`` of) their missing indices; marks them nacked."""
        now = self._clock() if now is None else now
        due = []
        with self._lock:
            for incoming in self._active.values():
                if now - max(incoming.last_activity, incoming.last_nack) >= idle:
                    incoming.last_nack = now
                    due.append((incoming.info, incoming.missing(limit)))
        return due

    def expire(self, now: float | None = None) -> list[TransferInfo]:
        """Drop transfers that received nothing for ``ttl`` seconds; return them."""
        now = self._clock() if now is None else now
        with self._lock:
            stale = [t for t, incoming in self._active.items() if now - incoming.last_activity >= self.ttl]
            expired = []
            for transfer in stale:
                expired.append(self._active.pop(transfer).info)
                self._finish(transfer, Status.REJECTED, f"expired after {self.ttl:g} s without a new chunk")
            return expired

    def discard(self, transfer: str, reason: str = "discarded by the receiver") -> bool:
        """Forget an active transfer (its later chunks are ignored); True if it was active."""
        with self._lock:
            if self._active.pop(transfer, None) is None:
                return False
            self._finish(transfer, Status.REJECTED, reason)
            return True

    def _open(self, info: TransferInfo, now: float) -> _Incoming:
        incoming = self._active.get(info.transfer)
        if incoming is not None:
            if incoming.info != info:
                raise ChunkError(f"chunk header of transfer {info.transfer} contradicts its earlier chunks")
            return incoming
        if self.federation is not None and info.federation != self.federation:
            raise ChunkError(f"chunk of federation {info.federation!r} sent to federation {self.federation!r}")
        if info.chunk > self.max_chunk_size:
            raise ChunkError(
                f"transfer {info.transfer} uses {info.chunk}-byte chunks; this receiver accepts at most "
                f"{self.max_chunk_size} (configure the same chunk size on both sides)"
            )
        if info.chunk < self.min_chunk_size and info.count > 1:
            raise ChunkError(
                f"transfer {info.transfer} uses {info.chunk}-byte chunks; this receiver takes chunks of at least {self.min_chunk_size} bytes"
            )
        if info.size > self.max_payload_bytes:
            raise ChunkError(
                f"transfer {info.transfer} of {info.size} bytes exceeds the {self.max_payload_bytes}-byte payload limit"
            )
        if len(self._active) >= self.max_transfers:
            raise ChunkError(
                f"refusing transfer {info.transfer}: {self.max_transfers} transfers are already in progress"
            )
        buffered = sum(incoming.info.size for incoming in self._active.values())
        if buffered + info.size > self.max_buffered_bytes:
            raise ChunkError(
                f"refusing transfer {info.transfer} of {info.size} bytes: {buffered} bytes are already buffered "
                f"(limit {self.max_buffered_bytes})"
            )
        incoming = _Incoming(info, started=now, last_activity=now)
        self._active[info.transfer] = incoming
        return incoming

    def _finish(self, transfer: str, status: Status, reason: str) -> None:
        self._finished[transfer] = (status, reason)
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)


@dataclass
class _Outgoing:
    info: TransferInfo
    payload: bytes | bytearray | memoryview
    created: float
    resent: int = 0  # chunks sent again on request


class Outbox:
    """Sender side: payloads kept for resends until acknowledged or expired (thread-safe)."""

    def __init__(
        self,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        ttl: float = 600.0,
        max_transfers: int = 64,
        resend_factor: float = 3.0,
        clock: Clock = time.monotonic,
    ) -> None:
        """``resend_factor``: nacks may ask for at most this many times a transfer's chunks in all; past that it is dropped."""
        self.chunk_size = validate_chunk_size(chunk_size)
        self.ttl = ttl
        self.max_transfers = max_transfers
        self.resend_factor = resend_factor
        self._clock = clock
        self._held: OrderedDict[str, _Outgoing] = OrderedDict()
        self._lock = threading.Lock()

    def add(
        self,
        payload: bytes | bytearray | memoryview,
        *,
        federation: str,
        round: int,
        device: str,
        transfer: str | None = None,
    ) -> TransferInfo:
        """Hash and hold ``payload``; the returned info names the transfer (evicts the oldest beyond max_transfers)."""
        info = describe(
            payload, federation=federation, round=round, device=device, transfer=transfer, chunk_size=self.chunk_size
        )
        with self._lock:
            self._held[info.transfer] = _Outgoing(info, payload, self._clock())
            while len(self._held) > self.max_transfers:
                self._held.popitem(last=False)
        return info

    def get(self, transfer: str) -> TransferInfo | None:
        """Info of a held transfer, or None."""
        with self._lock:
            outgoing = self._held.get(transfer)
            return outgoing.info if outgoing else None

    def frames(self, transfer: str, indices: Iterable[int] | None = None) -> Iterator[bytes]:
        """Frames of a held transfer (all, or the nacked ``indices``); ChunkError if unknown or out of range."""
        with self._lock:
            outgoing = self._held.get(transfer)
        if outgoing is None:
            raise ChunkError(f"transfer {transfer} is not held (never sent here, acknowledged or expired)")
        if indices is not None:
            indices = sorted(set(indices))
            bad = [i for i in indices if not 0 <= i < outgoing.info.count]
            if bad:
                raise ChunkError(
                    f"chunk indices {bad[:5]} are outside 0..{outgoing.info.count - 1} of transfer {transfer}"
                )
        return iter_frames(outgoing.info, outgoing.payload, indices)

    def charge_resend(self, transfer: str, chunks: int) -> bool:
        """Count ``chunks`` against the transfer's resend budget; False (and the transfer dropped) once it is spent."""
        with self._lock:
            outgoing = self._held.get(transfer)
            if outgoing is None:
                return False
            if outgoing.resent + chunks > self.resend_factor * outgoing.info.count:
                del self._held[transfer]
                return False
            outgoing.resent += chunks
            return True

    def release(self, transfer: str) -> bool:
        """Forget an acknowledged transfer; True if it was held."""
        with self._lock:
            return self._held.pop(transfer, None) is not None

    def expire(self, now: float | None = None) -> list[TransferInfo]:
        """Forget transfers held longer than ``ttl`` seconds; return them."""
        now = self._clock() if now is None else now
        with self._lock:
            stale = [t for t, outgoing in self._held.items() if now - outgoing.created >= self.ttl]
            return [self._held.pop(t).info for t in stale]

    def __contains__(self, transfer: object) -> bool:
        with self._lock:
            return transfer in self._held

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
