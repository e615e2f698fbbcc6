"""What the server says to the agent: parsed in paho's thread, queued in arrival order for the agent's thread.

paho's network thread only parses and queues (and lets a client expect an
announced transfer at once); the agent's own thread takes the messages one at a
time and handles them. While a client waits for a round's payload nothing is
handled: the inbox notes, as each message arrives, whether it overtakes that
round (a newer round message for the client, or the federation's end), and the
wait asks it (:meth:`Inbox.overtaken`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from feast_edge.protocol import Finished, ModelReady, RoundStart, RoutedRequest, SecAggBox, SecAggRoster, SecAggUnmask
from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.link import Link, Received
from feast_edge.transport.messages import Message, Presence, parse
from feast_edge.transport.throttle import Throttle, channel_of
from feast_edge.transport.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Incoming:
    """A queued message: its channel (``ctrl`` or ``server``), arrival time (monotonic) and place in arrival order."""

    channel: str
    message: Message
    at: float
    number: int


class Inbox:
    """The agent's subscriptions: each message parsed, checked against its topic and queued for the agent's thread."""

    def __init__(
        self,
        topics: Topics,
        on_announce: Callable[[str, RoundStart | ModelReady | RoutedRequest], None],
        size: int = 10_000,
        on_secure: Callable[[Message], None] | None = None,
    ):
        """``on_announce(device_id, message)`` runs in paho's thread for a round or model message, before it queues;
        ``on_secure(message)`` takes a secure round's start (which queues too) and its stage messages (which do not)."""
        self.topics = topics
        self._on_announce = on_announce
        self._on_secure = on_secure
        self._queue: queue.Queue[Incoming] = queue.Queue(maxsize=size)
        self._dropped = Throttle(log)  # bad input is logged, at most a few lines a minute per kind
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        self._latest_round: dict[str, str] = {}  # device -> msg_id of its newest round message
        self._news: dict[str, int] = {}  # device -> number of its newest round message or end of the federation
        self.instance = ""  # this agent's instance: only a finished naming it ends anything

    def subscribe(self, link: Link, devices: Iterable[str], host: str, on_own_offline: Callable[[], None]) -> None:
        """Every hosted client's control topic, the server's presence, and this agent's own (``on_own_offline``: someone
        else's offline status appeared on it)."""
        for device_id in devices:
            link.subscribe(self.topics.ctrl(device_id), self._on_ctrl(device_id))
        link.subscribe(self.topics.server_status, self._on_server_status)

        def on_own_status(received: Received) -> None:
            # Someone else's last will or clean exit (e.g. a refused duplicate agent that crashed); retained copies
            # are history, not news.
            if received.retain or not received.payload:
                return
            message = self._parse(received)
            if isinstance(message, Presence) and message.state == "offline":
                on_own_offline()

        link.subscribe(self.topics.status(host), on_own_status)

    def get(self, timeout: float) -> Incoming | None:
        """The next message, waiting up to ``timeout`` seconds for one (none: not at all); None if there is none."""
        try:
            return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def overtaken(self, device_id: str, number: int) -> bool:
        """Whether a new round message for ``device_id``, or the federation's end, arrived after message ``number``."""
        with self._lock:
            return self._news.get(device_id, 0) > number

    # ------------------------------------------------------------------ paho's thread
    def _on_ctrl(self, device_id: str) -> Callable[[Received], None]:
        def handle(received: Received) -> None:
            message = self._parse(received)
            if message is None:
                return
            if message.device != device_id:
                self._dropped.warning(
                    f"name {device_id}",
                    "dropped %s on %s: it names device %r",
                    message.kind,
                    received.topic,
                    message.device,
                )
                return
            if isinstance(message, (RoundStart, RoutedRequest)) and message.instance != self.instance:
                self._dropped.log(
                    logging.INFO,
                    f"instance {device_id}",
                    "dropped %s for %s: it is addressed to agent instance %s, this agent is %s (replayed from an earlier run?)",
                    message.kind,
                    device_id,
                    message.instance[:16],
                    self.instance,
                )
                return
            if isinstance(message, (SecAggRoster, SecAggBox, SecAggUnmask)):
                if self._on_secure is not None and message.federation == self.topics.federation:
                    self._on_secure(message)  # answered at once by the secure-aggregation worker, never queued
                return
            if isinstance(message, (RoundStart, ModelReady, RoutedRequest)):
                self._on_announce(device_id, message)
            if isinstance(message, RoundStart) and message.secure and self._on_secure is not None:
                if message.federation == self.topics.federation:
                    self._on_secure(message)  # its keys go out now, while the round waits its turn to train
            self._put("ctrl", message)

        return handle

    def _on_server_status(self, received: Received) -> None:
        if not received.payload:
            return
        message = self._parse(received)
        if isinstance(message, Presence) and message.role == "server":
            self._put("server", message)

    def _parse(self, received: Received) -> Message | None:
        try:
            self.topics.parse(received.topic)
            return parse(received.payload)
        except (ProtocolError, TopicError) as exc:
            key = f"malformed {channel_of(received.topic)}"
            self._dropped.warning(key, "dropped malformed message on %s: %s", received.topic, exc)
            return None

    def _put(self, channel: str, message: Message) -> None:
        with self._lock:
            incoming = Incoming(channel, message, time.monotonic(), next(self._numbers))
            try:
                self._queue.put_nowait(incoming)
            except queue.Full:
                self._dropped.warning("inbox", "agent inbox full; dropped a %s message", message.kind)
                return
            if message.federation != self.topics.federation:
                return
            device = message.device
            if isinstance(message, RoundStart) and self._latest_round.get(device) != message.msg_id:  # not a repeat
                self._latest_round[device] = message.msg_id
                self._news[device] = incoming.number
            elif isinstance(message, Finished) and message.instance == self.instance:
                self._news[device] = incoming.number
