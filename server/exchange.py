"""One round's send-and-receive over MQTT: a message and a payload to each cohort device, their replies back (docs/protocol.md §7).

    open(t)                                      round t's deadline starts now
    per device: describe(device, payload) -> the transfer to name in the message; send(device, message, payload, ...)
    replies()  -> each settled reply as it comes (an announced upload with its bytes, or why none will come),
                  until every device settled or went offline, or the deadline
    close()    -> who never replied, who went offline, what was ignored

Asynchronous rounds (feast_edge.server.jobs) keep it open: ``open(t, keep=True)`` before each refill of the slots
leaves the requests in flight open, each until its own deadline (``--round-timeout`` from when it was sent), and
each device's reply is matched against the version it was sent; ``arrivals(wait)`` hands over what settled, each
device's request closing as its reply, deadline or departure settles it.

It knows messages, transfers and devices, nothing of what the payloads hold:
``collect.DeviceCollector`` builds them and checks what comes back. Every wait
runs the server's event loop (``events.Events.pump``), which hands this
exchange the replies, finished uploads and offline hosts it sees.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from feast_edge.protocol import Declined, Evaluated, Update
from feast_edge.protocol.round_messages import shown_round
from feast_edge.server.waiting import Pump, Roster, wait_online
from feast_edge.transport.chunks import Progress, Status
from feast_edge.transport.errors import ChunkError, LinkError, ProtocolError
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.messages import Message
from feast_edge.transport.throttle import Throttle
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender
from feast_edge.util.text import duration

log = logging.getLogger(__name__)

HEARTBEAT = 10.0  # seconds between "still waiting" lines
POLL_EVERY = 0.5  # seconds between nacks of stalled uploads
UNCLAIMED = 64  # finished uploads kept while their announcement is on its way
MAX_IGNORED = 100  # ignored messages a round keeps the description of (the rest are counted)
REJECTED, DECLINED, INCOMPLETE = "rejected", "declined", "incomplete"  # why a device's reply does not count
MISSING, DROPPED = "missing", "dropped"  # asynchronous rounds: no reply by its deadline; its host went offline


@dataclass(frozen=True)
class ExchangeSettings:
    """How long the exchange waits, and the horizon its log lines name."""

    rounds: int
    round_timeout: float
    send_timeout: float = 120.0
    wait_timeout: float | None = None  # for enough devices online (None: forever)


@dataclass(frozen=True)
class Expect:
    """What a device's reply may announce: an upload of at most ``max_bytes``, weighted by 1..``max_samples`` samples."""

    max_bytes: int
    max_samples: int


@dataclass(frozen=True)
class Reply:
    """A device's settled reply: its announced update and the upload's bytes, its evaluation, or ``error`` (why none will count)."""

    device: str
    update: Update | None = None
    payload: bytes | None = None
    chunks: int = 0  # the upload's
    error: str = ""
    outcome: str = ""  # with ``error``: "rejected" (what it sent is refused), "declined" (it said no update will come)
    # or "incomplete" (its routed payload or its announced upload did not get through); asynchronous rounds also
    # settle "missing" (nothing by its deadline) and "dropped" (its host went offline)
    evaluation: Evaluated | None = None  # the answer to an evaluation request (no upload)

    @property
    def size(self) -> int:
        return 0 if self.payload is None else len(self.payload)


@dataclass(frozen=True)
class Unsettled:
    """What a closed round leaves: cohort devices that never replied, those that went offline, messages ignored."""

    missing: list[str]
    dropped: list[str]
    ignored: list[str]


@dataclass
class _Pending:
    """The exchange's side of one cohort device in the round in flight."""

    routed: str  # transfer id of the payload sent to it
    expect: Expect
    t: int  # the round (version) it was sent
    deadline: float
    update: Update | None = None
    error: str | None = None
    finished: bool = False  # its upload was handed over

    @property
    def settled(self) -> bool:
        return self.finished or self.error is not None


@dataclass
class _Round:
    t: int
    deadline: float
    pending: dict[str, _Pending] = field(default_factory=dict)
    settled: deque[Reply] = field(default_factory=deque)  # not yet handed to replies()
    dropped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    ignored_beyond: int = 0  # ignored messages past MAX_IGNORED, counted only


class RoundExchange:
    """Payloads down and announced uploads up for one round at a time, over one sender and one receiver."""

    def __init__(
        self, topics: Topics, sender: ChunkSender, receiver: ChunkReceiver, events: Pump, settings: ExchangeSettings
    ) -> None:
        self.topics, self.sender, self.receiver, self.events, self.settings = topics, sender, receiver, events, settings
        self.current: _Round | None = None
        # device -> (round, sent transfer, upload size bound) of the round in flight; read by paho's thread (pre_expect)
        self.announced: dict[str, tuple[int, str, int]] = {}
        # device -> the one upload transfer it may send in the round in flight: the first announcement that names the
        # round and its routed transfer takes it; later ones with another transfer id are refused before they take
        # anything (paho's thread and the run thread both claim, with setdefault: whichever comes first wins).
        self.claimed: dict[str, str] = {}
        self._unclaimed: OrderedDict[str, Progress] = (
            OrderedDict()
        )  # finished uploads whose announcement has not arrived
        self._dropped = Throttle(log)
        self._last_poll = 0.0

    def wait_online(self, needed: int, roster: Roster) -> list[str]:
        """Block until ``needed`` devices of ``roster`` are online (feast_edge.server.waiting)."""
        return wait_online(self.events, roster, needed, self.settings.wait_timeout)

    # ------------------------------------------------------------------ one round
    def open(self, t: int, keep: bool = False) -> None:
        """Start round ``t``: its deadline is ``round_timeout`` from now; uploads of earlier rounds are no longer taken.

        ``keep`` (asynchronous rounds): the requests in flight stay open until their own deadlines, and uploads of
        the versions they were sent are still taken."""
        deadline, current = time.monotonic() + self.settings.round_timeout, self.current
        if keep and current is not None:
            self.receiver.reassembler.advance(min([t, *(p.t for p in current.pending.values())]))
            current.t, current.deadline = t, deadline
            return
        self.receiver.reassembler.advance(t)
        self.current = _Round(t, deadline)
        self._unclaimed.clear()
        self.claimed = {}

    def time_left(self) -> float:
        """Seconds until the round's deadline (at least 1: what a device is told it has)."""
        assert self.current is not None, "open() first"
        return max(1.0, self.current.deadline - time.monotonic())

    def describe(self, device: str, payload: bytes) -> TransferInfo:
        """The transfer ``payload`` goes out as, to name in the message that announces it."""
        assert self.current is not None, "open() first"
        return self.sender.describe(payload, round=self.current.t, device=device)

    def send(
        self,
        device: str,
        message: Message,
        payload: bytes,
        info: TransferInfo,
        expect: Expect,
        also: Sequence[tuple[bytes, TransferInfo]] = (),
    ) -> bool:
        """``message`` on the device's control topic, then the chunks of ``payload`` and of each further payload the
        message names (``also``: an evaluation's further candidates); False (and a failed reply) if the link failed."""
        current = self.current
        assert current is not None, "open() first"
        current.pending[device] = _Pending(info.transfer, expect, current.t, current.deadline)
        self.announced[device] = (current.t, info.transfer, expect.max_bytes)
        self.claimed.pop(device, None)  # a device sent again (asynchronous rounds) may upload anew
        try:
            self.sender.announce_and_send(
                self.topics.ctrl(device), message.encode(), payload, info, timeout=self.settings.send_timeout
            )
            for blob, more in also:
                self.sender.send(
                    blob, round=more.round, device=device, transfer=more.transfer, timeout=self.settings.send_timeout
                )
        except LinkError as exc:
            self._fail(device, f"could not send its routed payload: {exc}", INCOMPLETE)
            sent = False
        else:
            sent = True
        self.events.pump(0)
        return sent

    def routed_of(self, device: str) -> str | None:
        """The routed transfer ``device`` was sent in the round in flight (None: it is not in it)."""
        pending = None if self.current is None else self.current.pending.get(device)
        return None if pending is None else pending.routed

    def give_up(self, device: str, reason: str) -> None:
        """Stop waiting for ``device``'s reply in the round in flight: none of it will count, because of ``reason``."""
        self._fail(device, reason, INCOMPLETE)

    def replies(self) -> Iterator[Reply]:
        """Each settled reply as it comes, until every device settled or went offline, or the deadline (KeyboardInterrupt on stop)."""
        current, rounds = self.current, self.settings.rounds
        assert current is not None, "open() first"
        last_note = time.monotonic()
        while True:
            while current.settled:
                yield current.settled.popleft()
            now = time.monotonic()
            waiting = [
                d for d, p in current.pending.items() if not p.settled and d not in current.dropped and now < p.deadline
            ]
            if not waiting or self.events.stop.is_set():
                break
            now = time.monotonic()
            if now - last_note >= HEARTBEAT:
                log.info(
                    "%s: %d of %d updates in; waiting for %s (%s left)",
                    shown_round(current.t, rounds),
                    len(current.pending) - len(waiting),
                    len(current.pending),
                    ", ".join(waiting),
                    duration(current.deadline - now),  # "24 h" where the server waits for every device (the demo)
                )
                last_note = now
            self.events.pump(min(0.1, max(0.0, current.deadline - time.monotonic())))
        if self.events.stop.is_set():
            raise KeyboardInterrupt
        self.drain()
        for device, pending in current.pending.items():
            if pending.update is not None and not pending.settled and device not in current.dropped:
                size = pending.update.transfer.get("size")
                self._fail(
                    device,
                    f"its announced upload ({size} bytes) did not complete before the round's deadline",
                    INCOMPLETE,
                )
        while current.settled:
            yield current.settled.popleft()

    def close(self) -> Unsettled:
        """End the round in flight: later replies to it are ignored."""
        current = self.current
        assert current is not None, "open() first"
        missing = [
            d
            for d, p in current.pending.items()
            if p.update is None and p.error is None and not p.finished and d not in current.dropped
        ]
        self.current, self.announced, self.claimed = None, {}, {}
        ignored = current.ignored + ([f"{current.ignored_beyond} more messages"] if current.ignored_beyond else [])
        return Unsettled(missing, current.dropped, ignored)

    # ------------------------------------------------------------------ events (from the event loop)
    def ignore(self, what: str) -> None:
        self._dropped.log(logging.INFO, what.split(":")[0], "ignored %s", what)
        current = self.current
        if current is not None:
            if len(current.ignored) < MAX_IGNORED:
                current.ignored.append(what)
            else:  # a flood: counted, not kept
                current.ignored_beyond += 1

    def on_offline(self, devices: list[str]) -> None:
        """Devices whose host went offline: a round in flight stops waiting for them."""
        current = self.current
        if current is None:
            return
        for device in devices:
            pending = current.pending.get(device)
            if pending is not None and not pending.settled and device not in current.dropped:
                current.dropped.append(device)
                log.warning("round %d: %s went offline; not waiting for its update", current.t + 1, device)

    def pre_expect(self, message: Update) -> None:
        """Paho's thread: take the chunks of an upload a cohort device just announced from the first one on.

        The reassembler takes only announced transfers (a stranger's frames cost nothing), and the chunks
        follow the announcement at once; :meth:`on_update` checks the rest in the run thread. A device has one
        upload slot per round: an announcement of another transfer than the one it claimed opens nothing (the
        first counts, as :meth:`on_update` keeps the first update; letting a later one replace it would let a
        device restart its upload, or hold many, all round).
        """
        slot = self.announced.get(message.device)
        if slot is None or slot[:2] != (message.round, message.routed):
            return
        try:
            info = message.transfer_info()
        except ProtocolError:
            return
        if info.size <= slot[2] and self.claimed.setdefault(message.device, info.transfer) == info.transfer:
            try:
                self.receiver.expect(info)
            except ChunkError:
                pass  # on_update, in the run thread, refuses the device's update with the reason

    def _answering(self, message: Declined | Evaluated) -> _Pending | None:
        """The open request ``message`` answers (its device's, of the version and routed transfer it was sent)."""
        current = self.current
        pending = None if current is None else current.pending.get(message.device)
        if pending is None or message.round != pending.t or message.routed != pending.routed or pending.settled:
            return None
        return pending

    def on_declined(self, message: Declined) -> None:
        """A cohort device says no update will come (training diverged or failed): stop waiting for it."""
        pending = self._answering(message)
        if pending is None or pending.update is not None:
            self.ignore(f"declined from {message.device}: it does not answer an open request of the round in flight")
            return
        self._fail(message.device, f"the device sent no update: {message.reason}", DECLINED)

    def on_evaluated(self, message: Evaluated) -> None:
        """A cohort device's answer to an evaluation request: counts only, no upload."""
        pending = self._answering(message)
        if pending is None or pending.expect.max_bytes:
            self.ignore(f"evaluated from {message.device}: it does not answer an open evaluation request")
            return
        assert self.current is not None
        pending.finished = True
        self.current.settled.append(Reply(message.device, evaluation=message))

    def on_update(self, message: Update) -> None:
        device, current = message.device, self.current
        pending = None if current is None else current.pending.get(device)
        if current is None or message.round != (current.t if pending is None else pending.t):
            self.ignore(f"update from {device}: round {message.round + 1} is not the round in flight")
            return
        if pending is None:
            self.ignore(f"update from {device}: not in round {current.t + 1}'s cohort")
            return
        if message.routed != pending.routed:
            self.ignore(
                f"update from {device}: it answers routed transfer {message.routed}, not this round's {pending.routed} (sent before a server restart?)"
            )
            return
        if pending.update is not None or self.claimed.setdefault(
            device, message.transfer.get("transfer")
        ) != message.transfer.get("transfer"):
            self.ignore(f"update from {device}: duplicate for round {current.t + 1} (the first one counts)")
            return
        try:
            info = message.transfer_info()
        except ProtocolError as exc:
            self._fail(device, f"invalid transfer description: {exc}")
            return
        problem, limit = "", pending.expect.max_samples
        if not pending.expect.max_bytes:
            problem = "it sent an update where its evaluation (counts only) was asked for"
        elif not 1 <= message.samples <= limit:
            # The sample count is the aggregation weight: more than the device registered would let it outweigh everyone.
            problem = f"it claims {message.samples} samples; the aggregation weight must be between 1 and the {limit} it registered"
        elif info.size > pending.expect.max_bytes:
            problem = f"its upload declares {info.size} bytes; the slice routed to it encodes to at most {pending.expect.max_bytes}"
        if problem:
            self.receiver.reassembler.discard(info.transfer, problem)
            self._fail(device, problem)
            return
        finished = self._unclaimed.pop(info.transfer, None)
        if finished is None:
            try:
                self.receiver.expect(info)
            except ChunkError as exc:  # its description is outside what the receiver takes (chunk size, federation...)
                self._fail(device, f"its upload cannot be taken: {exc}")
                return
        pending.update = message
        if finished is not None:
            self._finish(device, pending, finished)

    def tick(self) -> None:
        """Match finished uploads with their announcements, and nack stalled ones now and then."""
        self.drain()
        now = time.monotonic()
        if now - self._last_poll >= POLL_EVERY:
            self.receiver.poll()
            self._last_poll = now

    def drain(self) -> None:
        """Match finished upload transfers with their announcements."""
        while True:
            try:
                progress = self.receiver.results.get_nowait()
            except queue.Empty:
                return
            info, current = progress.info, self.current
            pending = current.pending.get(info.device) if current is not None else None
            if current is None or pending is None or info.round != pending.t:
                self._dropped.log(
                    logging.INFO,
                    f"upload {info.device}",
                    "dropped upload %s from %s: not expected in the round in flight",
                    info.transfer,
                    info.device,
                )
                continue
            if pending.update is None:
                self._unclaimed[info.transfer] = progress  # the update message may still be on its way
                while len(self._unclaimed) > UNCLAIMED:
                    self._unclaimed.popitem(last=False)
                continue
            if pending.update.transfer.get("transfer") != info.transfer:
                log.info(
                    "dropped upload %s from %s: its update announced transfer %s",
                    info.transfer,
                    info.device,
                    pending.update.transfer.get("transfer"),
                )
                continue
            self._finish(info.device, pending, progress)

    def _finish(self, device: str, pending: _Pending, progress: Progress) -> None:
        if pending.settled:
            return
        if progress.status is not Status.COMPLETE or progress.payload is None:
            reason = progress.reason or f"transfer {progress.status.value}"
            self._fail(device, reason, REJECTED if progress.corrupt else INCOMPLETE)
            return
        assert self.current is not None
        pending.finished = True
        self.current.settled.append(Reply(device, pending.update, progress.payload, progress.info.count))

    def _fail(self, device: str, reason: str, outcome: str = REJECTED) -> None:
        """No reply of ``device`` will count in the round in flight, because of ``reason`` (an ``outcome`` of :class:`Reply`)."""
        current = self.current
        if current is None:
            return
        pending = current.pending.get(device)
        if pending is not None and not pending.settled:
            pending.error = reason
        current.settled.append(Reply(device, error=reason, outcome=outcome))
