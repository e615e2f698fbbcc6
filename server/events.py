"""The server's event loop: what arrives from the broker, parsed in paho's thread and handled in the run thread.

    paho's thread:  topic + message checked -> Inbox (fair per device); an announced upload is expected at once
    the run thread: pump(seconds) -> each message to the piece whose job it is:
        status, register  -> devices.DeviceBook (offline hosts -> the round exchange)
        update, declined, evaluated -> exchange.RoundExchange
        secagg_keys, _shares, _reveal -> the secure round in flight (secure_round: secure.SecureStages)
        metrics           -> the registry (and the dashboard)
        model_request     -> serving.ModelServer

One thread handles the queue, so no state is touched from two threads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from feast_edge.errors import FeastError
from feast_edge.protocol import (
    Declined,
    Evaluated,
    Metrics,
    ModelRequest,
    Register,
    SecAggKeys,
    SecAggReveal,
    SecAggShares,
    Update,
    VersionReport,
)
from feast_edge.server.devices import DeviceBook
from feast_edge.server.exchange import RoundExchange
from feast_edge.server.inbox import Inbox
from feast_edge.server.live import LiveView
from feast_edge.server.serving import ModelServer
from feast_edge.server.versions import ServedVersions
from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.link import Received
from feast_edge.transport.messages import Message, MessageFilter, Presence, parse
from feast_edge.transport.throttle import Throttle, channel_of
from feast_edge.transport.topics import Topics
from feast_edge.util.text import printable

log = logging.getLogger(__name__)

SECURE_KINDS = (SecAggKeys, SecAggShares, SecAggReveal)  # a secure round's stage messages, device to server


class SecureRound(Protocol):
    """A secure round's stages in flight (feast_edge.server.secure.SecureStages): its messages and its deadlines."""

    def on_message(self, message: Message) -> None:
        """A stage message of a device (one of SECURE_KINDS)."""

    def tick(self) -> None:
        """End a stage whose deadline passed."""


class Events:
    """The inbox and the dispatch of its messages; the round exchange and the model server join once connected."""

    def __init__(self, topics: Topics, devices: DeviceBook, live: LiveView | None = None) -> None:
        self.topics, self.devices, self.live = topics, devices, live
        self.registry = devices.registry
        self.inbox = Inbox()
        self.stop = threading.Event()  # set: every wait ends (KeyboardInterrupt in a round)
        self.ending = threading.Event()  # set: a stop was requested (server.stopping): a wait for devices ends
        self.exchange: RoundExchange | None = None
        self.models: ModelServer | None = None
        self.versions: ServedVersions | None = None  # served versions and the devices' reports of them
        self._secure: SecureRound | None = None  # the secure round in flight (--secure-agg), while its stages run
        self.filter = MessageFilter(topics.federation)  # stale rounds and foreign federations
        self._dropped = Throttle(log)  # bad input is logged, a few lines a minute per kind and sender

    # ------------------------------------------------------------------ paho's thread
    def reconnected(self, presence: Presence) -> None:
        # Queued before the statuses that the new subscription brings: what the server knew of presence may be stale
        # (an agent that died while the broker was down left no last will), so it starts over from those statuses.
        self.inbox.put("reconnected", presence)

    def on_message(self, channel: str) -> Callable[[Received], None]:
        """The subscription handler of ``channel``: parse, check against the topic, queue."""

        def handle(received: Received) -> None:
            if channel == "status" and not received.payload:
                return  # a cleared retained status
            try:
                topic = self.topics.parse(received.topic)
                message = parse(received.payload)
            except (ProtocolError, TopicError) as exc:
                self._dropped.warning(
                    f"malformed {channel_of(received.topic)}",
                    "dropped malformed message on %s: %s",
                    received.topic,
                    exc,
                )
                return
            if topic.device is not None and message.device != topic.device:
                self._dropped.warning(
                    f"names {channel_of(received.topic)}",
                    "dropped %s message on %s: it names device %r",
                    message.kind,
                    received.topic,
                    message.device,
                )
                return
            if isinstance(message, Update) and self.exchange is not None:
                self.exchange.pre_expect(message)  # its chunks follow at once, in this thread
            self.inbox.put(channel, message)

        return handle

    # ------------------------------------------------------------------ the run thread
    @contextmanager
    def secure_round(self, stages: SecureRound) -> Iterator[None]:
        """Route the secure-stage messages to ``stages`` while the block runs; outside it they are ignored."""
        if self._secure is not None:
            raise RuntimeError("a secure round is already in flight: one at a time")
        self._secure = stages
        try:
            yield
        finally:
            self._secure = None

    def pump(self, seconds: float) -> None:
        """Handle incoming messages and finished transfers for ``seconds`` (0: only what is queued now)."""
        end = time.monotonic() + seconds
        while True:
            try:
                if self.exchange is not None:
                    self.exchange.tick()
                if self._secure is not None:
                    self._secure.tick()  # a key stage whose deadline passed
                if self.models is not None:
                    self.models.tick()  # model requests that waited for their device's interval
                if self.live is not None:
                    self.live.tick(
                        self.devices.hosts_online, None if self.exchange is None else self.exchange.receiver.reassembler
                    )
            except (
                Exception
            ):  # finished uploads and requests are the network's input too: never let one stop the server
                log.exception("failed to handle a finished transfer or a model request")
            got = self.inbox.get(0)
            if got is None:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return
                got = self.inbox.get(min(remaining, 0.05))
                if got is None:
                    continue
            channel, message = got
            try:
                self._handle(channel, message)
            except FeastError as exc:  # a bad message must never stop the server
                self._dropped.warning(
                    f"handle {message.device}", "could not handle %s from %s: %s", message.kind, message.device, exc
                )
            except Exception:  # nor a bug in handling one: log it with its traceback and go on
                log.exception("failed to handle %s from %s", message.kind, message.device)

    def _handle(self, channel: str, message: Message) -> None:
        verdict = self.filter.verdict(message)
        if verdict is not None:
            self.ignore(f"{message.kind} from {message.device}: {verdict}")
            return
        exchange = self.exchange
        if channel == "reconnected":
            self.devices.on_reconnect()
        elif channel == "status" and isinstance(message, Presence):
            offline = self.devices.on_presence(message)
            if offline and exchange is not None:
                exchange.on_offline(offline)
        elif channel == "register" and isinstance(message, Register):
            self.devices.on_register(message)
        elif channel == "events" and isinstance(message, Update) and exchange is not None:
            exchange.on_update(message)
        elif channel == "events" and isinstance(message, Declined) and exchange is not None:
            exchange.on_declined(message)
        elif channel == "events" and isinstance(message, Evaluated) and exchange is not None:
            exchange.on_evaluated(message)
        elif channel == "events" and isinstance(message, SECURE_KINDS):
            if self._secure is None:
                self.ignore(f"{message.kind} from {message.device}: no secure round is in flight")
            else:
                self._secure.on_message(message)
        elif channel == "events" and isinstance(message, Metrics):
            if self.registry.get(message.device) is not None:
                self.registry.touch(message.device, metrics=message.values)
                if self.live is not None:
                    self.live.device_progress(message.device, message.values)
                log.debug("metrics from %s: %s", message.device, json.dumps(message.values, sort_keys=True)[:300])
                refused = message.values.get("bn_refused")
                if isinstance(refused, str) and refused:  # the device's own check of its served model (one line)
                    log.warning("%s refused the federated BN statistics: %s", message.device, printable(refused))
        elif channel == "events" and isinstance(message, VersionReport) and self.versions is not None:
            dropped = self.versions.on_report(message, self.registry.get(message.device) is not None)
            if dropped is not None:
                self.ignore(f"{message.kind} from {message.device}: {dropped}")
        elif channel == "events" and isinstance(message, ModelRequest) and self.models is not None:
            self.models.request(message.device, message.msg_id)
        else:
            self.ignore(f"{message.kind} from {message.device}: it does not belong on the {channel} topic")

    def ignore(self, what: str) -> None:
        if self.exchange is not None:
            self.exchange.ignore(what)
        else:
            self._dropped.log(logging.INFO, what.split(":")[0], "ignored %s", what)
