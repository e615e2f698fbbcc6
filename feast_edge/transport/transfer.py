"""Chunked transfers over a Link: the sender answers nacks, the receiver nacks gaps and sends receipts (docs/protocol.md §4).

Direction 'down' is server -> device, 'up' is device -> server. For direction
D and device X, frames go to ``xfer/D/X`` and the receiver's feedback (nacks,
receipts) to ``xfer/nack/D/X``. The server uses ``device='+'`` to serve every
device with one sender and one receiver per direction.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from feast_edge.transport.chunks import Outbox, Progress, Reassembler, Status
from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE, TransferInfo, describe
from feast_edge.transport.link import Link, Received
from feast_edge.transport.messages import MAX_NACK_INDICES, Message, MessageFilter, Nack, Receipt, parse
from feast_edge.transport.throttle import Throttle, channel_of
from feast_edge.transport.topics import WILDCARD, Topics, validate_direction

log = logging.getLogger(__name__)
_dropped = Throttle(
    log
)  # what the network sends that is dropped: a few lines a minute per kind and sender, whatever the rate
_asking = Throttle(log, burst=3)  # the nacks this side sends for one stalled sender


class ChunkSender:
    """Publishes payloads as chunk frames, keeps them until a receipt or expiry, and resends nacked chunks."""

    def __init__(
        self,
        link: Link,
        topics: Topics,
        direction: str,
        *,
        device: str = WILDCARD,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        window: int = 16,
        ttl: float = 600.0,
    ) -> None:
        self.link = link
        self.topics = topics
        self.direction = validate_direction(direction)
        self.window = window
        self.chunk_size = chunk_size
        self.outbox = Outbox(chunk_size=chunk_size, ttl=ttl)
        self._filter = MessageFilter(topics.federation)
        self._receipts: dict[str, Receipt] = {}
        self._changed = threading.Condition()
        link.subscribe(topics.nack(direction, device), self._on_feedback)

    def send(
        self, payload: bytes, *, round: int, device: str, transfer: str | None = None, timeout: float = 120.0
    ) -> TransferInfo:
        """Publish every chunk of ``payload`` for ``device`` (pipelined, QoS 1) and return the transfer's info."""
        self.outbox.expire()
        info = self.outbox.add(
            payload, federation=self.topics.federation, round=round, device=device, transfer=transfer
        )
        topic = self.topics.xfer(self.direction, device)
        self.link.publish_many(topic, self.outbox.frames(info.transfer), window=self.window, timeout=timeout)
        log.debug("sent transfer %s: %d bytes in %d chunks to %s", info.transfer, info.size, info.count, topic)
        return info

    def describe(self, payload: bytes, *, round: int, device: str) -> TransferInfo:
        """The transfer of ``payload`` in this sender's chunk size, to name in an announcement before :meth:`announce_and_send`."""
        return describe(
            payload, federation=self.topics.federation, round=round, device=device, chunk_size=self.chunk_size
        )

    def announce_and_send(
        self, topic: str, announcement: bytes, payload: bytes, info: TransferInfo, timeout: float = 120.0
    ) -> TransferInfo:
        """Publish ``announcement`` (a message naming ``info``) on ``topic``, then the chunks of ``payload``.

        Announcing first lets the receiver expect, and nack, the transfer even if its first chunks are lost.
        """
        self.link.publish(topic, announcement)
        return self.send(payload, round=info.round, device=info.device, transfer=info.transfer, timeout=timeout)

    def resend(self, transfer: str, indices: list[int] | None = None) -> int:
        """Publish chunks of a held transfer again without waiting (all by default); return how many."""
        info = self.outbox.get(transfer)
        if info is None:
            return 0
        topic = self.topics.xfer(self.direction, info.device)
        count = 0
        for frame in self.outbox.frames(transfer, indices):  # raises ChunkError for bad indices before publishing any
            self.link.publish(topic, frame)
            count += 1
        return count

    def wait_receipt(self, transfer: str, timeout: float) -> Receipt | None:
        """The receiver's receipt for ``transfer``, or None if none came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while transfer not in self._receipts:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return self._receipts[transfer]

    def _on_feedback(self, received: Received) -> None:
        message = _parse_from(received, self.topics, self._filter, "feedback")
        if isinstance(message, Nack):
            info = self.outbox.get(message.transfer)
            if info is None or info.device != message.device:
                _dropped.log(
                    logging.INFO,
                    f"nack {message.device}",
                    "nack for transfer %s that is not held here; ignored",
                    message.transfer,
                )
                return
            if not self.outbox.charge_resend(message.transfer, len(set(message.missing))):
                _dropped.warning(
                    f"resends {message.device}",
                    "%s asked for more of transfer %s than %g times its chunks; dropped it (no more resends)",
                    message.device,
                    message.transfer,
                    self.outbox.resend_factor,
                )
                return
            try:
                count = self.resend(message.transfer, list(message.missing))
            except ProtocolError as exc:
                _dropped.warning(f"nack {message.device}", "dropped nack from %s: %s", message.device, exc)
                return
            log.info("resent %d chunks of transfer %s to %s", count, message.transfer, message.device)
        elif isinstance(message, Receipt):
            self.outbox.release(message.transfer)
            if not message.ok:
                log.warning("%s rejected transfer %s: %s", message.device, message.transfer, message.reason)
            with self._changed:
                self._receipts[message.transfer] = message
                if len(self._receipts) > 4096:
                    self._receipts.pop(next(iter(self._receipts)))
                self._changed.notify_all()
        elif message is not None:
            _dropped.warning(
                f"unexpected {channel_of(received.topic)}",
                "unexpected %s message on %s; ignored",
                message.kind,
                received.topic,
            )


@dataclass
class _Awaited:
    """A sent transfer whose receipt has not come yet."""

    owner: str
    sender: ChunkSender
    topic: str
    announcement: bytes
    info: TransferInfo
    until: float  # no repeat after this monotonic time
    due: float  # repeat at this monotonic time if no receipt came
    attempt: int = 1


class Confirmations:
    """Receipts awaited for sent transfers, without blocking the caller; a transfer without one is sent again.

    A restarted broker drops what reached it before the receiver subscribed again; the receiver drops a repeated
    announcement (same message id) and answers repeated chunks of a finished transfer with its receipt again, so
    sending again is always safe. An agent hosting many virtual clients trains the next one while the server's
    receipt for the previous upload is on its way (a blocking wait costs one round trip per client, one after the
    other); it calls :meth:`check` now and then, which announces and sends again what got no receipt within
    ``receipt_wait``, at most ``attempts - 1`` times and never after the transfer's ``until``.
    """

    def __init__(self, *, receipt_wait: float = 10.0, attempts: int = 3) -> None:
        self.receipt_wait, self.attempts = receipt_wait, attempts
        self._awaited: dict[str, _Awaited] = {}  # transfer -> its state

    def __len__(self) -> int:
        return len(self._awaited)

    def add(
        self, owner: str, sender: ChunkSender, topic: str, announcement: bytes, info: TransferInfo, *, until: float
    ) -> None:
        """After ``sender.announce_and_send(topic, announcement, ..., info)``: await its receipt (``owner``: whose upload it is)."""
        self._awaited[info.transfer] = _Awaited(
            owner, sender, topic, announcement, info, until, time.monotonic() + self.receipt_wait
        )

    def check(self, cancelled: Callable[[str], bool] = lambda owner: False) -> None:
        """Forget the receipted (and ``cancelled`` owners'); announce and send again what is due, at most ``attempts - 1`` times."""
        now = time.monotonic()
        for transfer, a in list(self._awaited.items()):
            if cancelled(a.owner) or a.sender.wait_receipt(transfer, 0) is not None:
                del self._awaited[transfer]
            elif now >= a.due:
                if a.attempt >= self.attempts or now > a.until:
                    del self._awaited[transfer]
                    continue
                log.warning(
                    "no receipt for transfer %s within %g s (lost across a broker restart?); sending it again",
                    transfer,
                    self.receipt_wait,
                )
                a.sender.link.publish(a.topic, a.announcement)
                a.sender.resend(transfer)
                a.attempt, a.due = a.attempt + 1, now + self.receipt_wait


class ChunkReceiver:
    """Reassembles incoming transfers, nacks the chunks that do not come, and answers each transfer with a receipt."""

    def __init__(
        self,
        link: Link,
        topics: Topics,
        direction: str,
        *,
        device: str = WILDCARD,
        nack_after: float = 1.0,
        reassembler: Reassembler | None = None,
        on_result: Callable[[Progress], None] | None = None,
    ) -> None:
        """``on_result`` is called with each finished transfer, from paho's thread or the one calling ``poll``."""
        self.link = link
        self.topics = topics
        self.direction = validate_direction(direction)
        self.nack_after = nack_after
        self.reassembler = reassembler or Reassembler(federation=topics.federation)
        self.results: queue.Queue[Progress] = queue.Queue()
        self._on_result = on_result
        self._last_receipt: dict[str, float] = {}
        self._receipt_lock = threading.Lock()
        link.subscribe(topics.xfer(direction, device), self._on_frame)

    def get(self, timeout: float, poll_interval: float = 0.2) -> Progress | None:
        """Next finished transfer (COMPLETE with payload, or REJECTED with reason), nacking gaps while waiting; None on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                return self.results.get(timeout=min(remaining, poll_interval))
            except queue.Empty:
                self.poll()

    def expect(self, info: TransferInfo) -> None:
        """Announce a transfer (from a control message) so that it is nacked even if no chunk of it arrives."""
        self.reassembler.expect(info)

    def poll(self, now: float | None = None) -> None:
        """Nack stalled transfers and expire dead ones; call it periodically (``get`` does)."""
        for info, missing in self.reassembler.stalled(self.nack_after, now, limit=MAX_NACK_INDICES):
            nack = Nack(
                federation=info.federation,
                round=info.round,
                device=info.device,
                transfer=info.transfer,
                missing=tuple(missing[:MAX_NACK_INDICES]),
            )
            _asking.log(  # a stalled transfer is asked again every nack_after seconds: a few lines a minute per sender
                logging.INFO,
                f"nack:{info.device}",
                "transfer %s from %s: asking again for %d missing chunks",
                info.transfer,
                info.device,
                len(missing),  # at most one nack's worth
            )
            self.link.publish(self.topics.nack(self.direction, info.device), nack.encode())
        for info in self.reassembler.expire(now):
            reason = f"expired after {self.reassembler.ttl:g} s without a new chunk"
            log.warning("transfer %s from %s %s", info.transfer, info.device, reason)
            self._finish(Progress(info, -1, Status.REJECTED, reason=reason))

    def _on_frame(self, received: Received) -> None:
        try:
            topic = self.topics.parse(received.topic)
            progress = self.reassembler.add(received.payload, device=topic.device)
        except (ProtocolError, TopicError) as exc:
            _dropped.warning(f"chunk {channel_of(received.topic)}", "dropped chunk on %s: %s", received.topic, exc)
            return
        log.debug(
            "chunk %d/%d of transfer %s: %s",
            progress.index,
            progress.info.count,
            progress.info.transfer,
            progress.status.value,
        )
        if progress.status is Status.PARTIAL and progress.reason:  # started over after a failed hash
            log.warning("transfer %s from %s: %s", progress.info.transfer, progress.info.device, progress.reason)
        if progress.status in (Status.COMPLETE, Status.REJECTED):
            if progress.status is Status.REJECTED:
                log.warning(
                    "rejected transfer %s from %s: %s", progress.info.transfer, progress.info.device, progress.reason
                )
            self._finish(progress)
        elif progress.status is Status.UNEXPECTED:
            log.debug(
                "ignored chunk %d of unannounced transfer %s from %s",
                progress.index,
                progress.info.transfer,
                progress.info.device,
            )
        elif progress.status is Status.FINISHED:
            # The sender resends because our receipt got lost: answer again, at most once a second.
            self._send_receipt(progress, throttle=1.0)

    def _finish(self, progress: Progress) -> None:
        self._send_receipt(progress)
        self.results.put(progress)
        if self._on_result is not None:
            self._on_result(progress)

    def _send_receipt(self, progress: Progress, throttle: float = 0.0) -> None:
        info, now = progress.info, time.monotonic()
        with self._receipt_lock:
            if now - self._last_receipt.get(info.transfer, float("-inf")) < throttle:
                return
            self._last_receipt[info.transfer] = now
            if len(self._last_receipt) > 4096:
                self._last_receipt.pop(next(iter(self._last_receipt)))
        outcome = self.reassembler.outcome(info.transfer)
        ok = progress.status is Status.COMPLETE or (outcome is not None and outcome[0] is Status.COMPLETE)
        reason = progress.reason or ("" if outcome is None else outcome[1])
        receipt = Receipt(
            federation=info.federation,
            round=info.round,
            device=info.device,
            transfer=info.transfer,
            ok=ok,
            reason=reason,
        )
        self.link.publish(self.topics.nack(self.direction, info.device), receipt.encode())


def _parse_from(received: Received, topics: Topics, gate: MessageFilter, what: str) -> Message | None:
    """Parse a control message and check it against its topic; log and return None when it must be dropped."""
    try:
        topic = topics.parse(received.topic)
        message = parse(received.payload)
    except (ProtocolError, TopicError) as exc:
        _dropped.warning(f"{what} {channel_of(received.topic)}", "dropped %s on %s: %s", what, received.topic, exc)
        return None
    if topic.device is not None and message.device != topic.device:
        _dropped.warning(
            f"{what} {channel_of(received.topic)}",
            "dropped %s on %s: it names device %r",
            what,
            received.topic,
            message.device,
        )
        return None
    reason = gate.verdict(message)
    if reason is not None:
        _dropped.log(
            logging.INFO, f"{what} {channel_of(received.topic)}", "dropped %s on %s: %s", what, received.topic, reason
        )
        return None
    return message
