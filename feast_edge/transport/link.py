"""One MQTT connection, shared by server and device agent: a thin layer over paho-mqtt 2 (docs/protocol.md §1).

``Link`` adds to paho's client what both sides need: broker URLs, TLS and
credentials from one config, errors that say how to fix the connection,
retained presence with a last will, re-subscription after paho's automatic
reconnects, QoS 1 publishing with a bounded in-flight window for chunk
streams, and per-filter handlers or an inbox queue. paho's network thread runs
the handlers; they must be quick and must not wait for acknowledgements.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion

from feast_edge.transport.broker import PROTOCOLS, LinkConfig, connection_error, parse_broker_url, refusal, tls_context
from feast_edge.transport.errors import LinkError
from feast_edge.transport.messages import Presence, new_msg_id
from feast_edge.transport.signing import SignatureError
from feast_edge.transport.throttle import Throttle, channel_of
from feast_edge.transport.topics import Topics

log = logging.getLogger(__name__)
paho_log = logging.getLogger(f"{__name__}.paho")  # paho's own lines


@dataclass(frozen=True)
class Received:
    """One incoming message."""

    topic: str
    payload: bytes
    retain: bool = False
    qos: int = 0


Handler = Callable[[Received], None]


class Link:
    """An MQTT connection with presence, re-subscription, pipelined QoS 1 publishing and clear errors."""

    def __init__(
        self, config: LinkConfig, *, presence: Presence | None = None, on_reconnect: Callable[[], None] | None = None
    ) -> None:
        self.config = config
        # Runs in paho's thread after a reconnect, before the filters are subscribed again (so before any retained message).
        self.on_reconnect = on_reconnect
        self.address = parse_broker_url(config.broker)
        self.presence = presence
        self.status_topic = None if presence is None else _status_topic(presence)
        if config.protocol not in PROTOCOLS:
            raise LinkError(f"MQTT protocol {config.protocol!r} is not supported; use '3.1.1' or '5'")
        self._v5 = PROTOCOLS[config.protocol] == MQTTProtocolVersion.MQTTv5
        self.client_id = config.client_id or f"feast-{uuid.uuid4().hex[:16]}"
        # With credentials every message is signed, and one that does not verify never reaches a handler.
        self.keyring = None if config.credentials is None else config.credentials.keyring()
        self._dropped = Throttle(log)
        self.inbox: queue.Queue[Received] = queue.Queue(maxsize=config.inbox_size)
        self._subscriptions: dict[str, int] = {}
        self._subacks: dict[int, tuple[threading.Event, list[Any]]] = {}  # mid -> (SUBACK came, its reason codes)
        self._last_qos1: mqtt.MQTTMessageInfo | None = None  # the latest QoS 1 message published
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._connack = threading.Event()
        self._connect_error: LinkError | None = None
        self._resubscribed: threading.Event | None = None
        self._handler_thread = threading.local()
        self._connecting = False
        self._started = False
        self._closing = False
        self._client = self._make_client()

    # --- setup ---------------------------------------------------------------------------------

    def _make_client(self) -> mqtt.Client:
        config, address = self.config, self.address
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=None if self._v5 else config.clean_session,
            protocol=PROTOCOLS[config.protocol],
            reconnect_on_failure=True,
        )
        client.on_log = self._on_log
        client.max_inflight_messages_set(config.max_inflight)
        client.reconnect_delay_set(config.reconnect_min_delay, config.reconnect_max_delay)  # type: ignore[arg-type]
        username = config.username if config.username is not None else address.username
        password = config.password if config.password is not None else address.password
        if username is not None:
            client.username_pw_set(username, password)
        tls_options = [config.ca_file, config.cert_file, config.key_file, config.tls_insecure]
        if any(tls_options) and not address.tls:
            raise LinkError(
                f"TLS options (--ca-file/--cert-file/--key-file/--tls-insecure) need a TLS broker URL, "
                f"got {config.broker!r}; use mqtts://{address}"
            )
        if address.tls:
            client.tls_set_context(tls_context(config))
        if self.presence is not None:
            offline = dataclasses.replace(self.presence, state="offline", msg_id=new_msg_id())
            client.will_set(self.status_topic, self._seal(self.status_topic, offline.encode()), qos=1, retain=True)
        client.on_socket_open = _no_delay
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        return client

    # --- connection ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Block until connected (e.g. after a reconnect); False on timeout."""
        return self._connected.wait(timeout)

    def connect(self, timeout: float = 10.0) -> None:
        """Connect, or raise a LinkError saying why not within ``timeout`` seconds; then keep reconnecting in the background."""
        if self._started:
            return
        address = self.address
        self._connack.clear()
        self._connect_error = None
        self._connecting = True
        self._client.connect_timeout = timeout
        try:
            try:
                self._client.connect(address.host, address.port, self.config.keepalive)
            except OSError as exc:  # ssl.SSLError, refused, unresolvable, silent: each says how to fix it
                raise connection_error(exc, address, timeout) from None
            self._await_connack(timeout)
        finally:
            self._connecting = False
        self._client.loop_start()
        self._started = True
        log.debug("connected to MQTT broker at %s as %s", address, self.client_id)  # the applications say who they are

    def _await_connack(self, timeout: float) -> None:
        """Run paho's loop in this thread until CONNACK, so a refused first connection never starts the reconnect thread."""
        deadline = time.monotonic() + timeout
        while not self._connack.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._client.disconnect()
                raise LinkError(
                    f"MQTT broker at {self.address} sent no CONNACK within {timeout:g} s; is {self.address} an MQTT "
                    f"{'TLS ' if self.address.tls else ''}port? check --broker"
                )
            rc = self._client.loop(timeout=min(remaining, 0.1))
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS and not self._connack.is_set():
                if self.address.tls:
                    hint = "if the broker requires a client certificate give --cert-file/--key-file; otherwise check the broker's log"
                else:
                    hint = f"if {self.address} is a TLS listener use mqtts://; otherwise check the broker's log"
                raise LinkError(
                    f"MQTT broker at {self.address} closed the connection before CONNACK ({mqtt.error_string(rc)}); {hint}"
                )
        if self._connect_error is not None:
            self._client.disconnect()
            raise self._connect_error
        # Filters subscribed before connect() are live when it returns.
        while self._resubscribed is not None and not self._resubscribed.is_set() and time.monotonic() < deadline:
            self._client.loop(timeout=min(deadline - time.monotonic(), 0.1))

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._connect_error = refusal(reason_code, self.address, self.config.username)
            if not self._connecting:
                log.error("reconnect failed: %s", self._connect_error)
            self._connack.set()
            return
        if not self._connecting and self.on_reconnect is not None:
            self.on_reconnect()
        # Under the lock, so that a concurrent subscribe() either is in this list or sees the link connected.
        with self._lock:
            subscriptions = list(self._subscriptions.items())
            if subscriptions:  # a clean session forgets them; re-subscribe after every (re)connect
                result, mid = client.subscribe(subscriptions)
                if result == MQTTErrorCode.MQTT_ERR_SUCCESS:
                    self._resubscribed = threading.Event()
                    self._subacks[mid] = (self._resubscribed, [])
            self._connected.set()
        if self.presence is not None:
            online = dataclasses.replace(self.presence, state="online", msg_id=new_msg_id())
            client.publish(self.status_topic, self._seal(self.status_topic, online.encode()), qos=1, retain=True)  # type: ignore[arg-type]
        if not self._connecting:
            log.info("reconnected to MQTT broker at %s; re-subscribed %d filters", self.address, len(subscriptions))
        self._connack.set()

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        self._connected.clear()
        if not self._closing and not self._connecting:
            log.warning(
                "lost connection to MQTT broker at %s (%s); reconnecting with backoff", self.address, reason_code
            )

    def _on_log(self, client: mqtt.Client, userdata: Any, level: int, text: str) -> None:
        """paho's lines, into ``paho_log``."""
        if self._closing and text.startswith("Client is not connected"):
            # After our DISCONNECT paho's thread polls the closed socket once more unless loop_stop() came first (a race
            # close() cannot win: a PUBACK for a message arriving meanwhile keeps the thread running) and says so at error
            # level (paho 2.2). Expected while closing; anywhere else it is a real failure and stays an error.
            paho_log.debug("%s", text)
        else:
            paho_log.log(mqtt.LOGGING_LEVEL[level], "%s", text)

    # --- subscriptions ---------------------------------------------------------------------------

    def subscribe(
        self, topic_filter: str, handler: Handler | None = None, *, qos: int = 1, timeout: float = 10.0
    ) -> None:
        """Subscribe ``topic_filter`` (kept across reconnects); ``handler`` runs in paho's thread, else messages go to ``inbox``."""
        if handler is not None:
            self._client.message_callback_add(topic_filter, self._guard(handler))
        with self._lock:
            self._subscriptions[topic_filter] = qos
            if not self.connected:
                return  # subscribed on connect
            result, mid = self._client.subscribe(topic_filter, qos)
            if result != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return  # the connection dropped meanwhile; _on_connect re-subscribes
            done, codes = self._subacks[mid] = (threading.Event(), [])
        if not done.wait(timeout):
            raise LinkError(
                f"MQTT broker at {self.address} did not acknowledge the subscription to {topic_filter!r} within {timeout:g} s"
            )
        if any(getattr(code, "is_failure", False) for code in codes):
            raise LinkError(
                f"MQTT broker at {self.address} refused the subscription to {topic_filter!r} ({codes[0]}); check the broker's ACL"
            )

    def unsubscribe(self, topic_filter: str) -> None:
        """Stop receiving ``topic_filter``."""
        with self._lock:
            self._subscriptions.pop(topic_filter, None)
        self._client.message_callback_remove(topic_filter)
        if self.connected:
            self._client.unsubscribe(topic_filter)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any) -> None:
        with self._lock:
            waiter = self._subacks.pop(mid, None)
        if waiter is not None:
            waiter[1].extend(reason_codes)
            waiter[0].set()
        refused = [code for code in reason_codes if getattr(code, "is_failure", False)]
        if refused:
            log.error("MQTT broker at %s refused a subscription (%s); check the broker's ACL", self.address, refused[0])

    def _seal(self, topic: str, payload: bytes) -> bytes:
        return (
            payload if self.keyring is None else self.keyring.seal(topic, payload)
        )  # chunk frames pass through uncopied

    def _admit(self, message: mqtt.MQTTMessage) -> Received | None:
        """The message as handlers see it: its signature checked and removed (with credentials); None when it is dropped."""
        payload = message.payload
        if self.keyring is not None:
            try:
                payload = self.keyring.open(message.topic, payload)
            except SignatureError as exc:
                self._dropped.warning(f"signature {channel_of(message.topic)}", "dropped a message: %s", exc)
                return None
        return Received(message.topic, payload, bool(message.retain), message.qos)

    def _guard(self, handler: Handler) -> Callable[[mqtt.Client, Any, mqtt.MQTTMessage], None]:
        def call(client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
            received = self._admit(message)
            if received is None:
                return
            self._handler_thread.active = True
            try:
                handler(received)
            except Exception as exc:  # a handler bug must not kill paho's network thread
                # Rate-limited per channel like every drop (a sender could trigger it at will); the traceback goes to
                # the debug log only.
                self._dropped.log(
                    logging.ERROR,
                    f"handler {channel_of(message.topic)}",
                    "handler for %s failed: %s: %s",
                    message.topic,
                    type(exc).__name__,
                    str(exc)[:300],
                )
                log.debug("handler for %s failed", message.topic, exc_info=True)
            finally:
                self._handler_thread.active = False

        return call

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        received = self._admit(message)
        if received is None:
            return
        try:
            self.inbox.put_nowait(received)
        except queue.Full:
            self._dropped.warning(
                "inbox full", "inbox full (%d messages); dropped a message on %s", self.inbox.maxsize, message.topic
            )

    def get(self, timeout: float | None = None) -> Received | None:
        """Next inbox message, or None after ``timeout`` seconds."""
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    # --- publishing ------------------------------------------------------------------------------

    def publish(
        self,
        topic: str,
        payload: bytes | bytearray,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float | None = None,
    ) -> mqtt.MQTTMessageInfo:
        """Publish (queued by paho while offline; signed with credentials); with ``timeout``, wait for the PUBACK or raise LinkError."""
        info = self._client.publish(topic, self._seal(topic, payload), qos=qos, retain=retain)
        if info.rc == MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
            raise LinkError(f"paho's outgoing queue is full; message to {topic!r} not sent")
        if qos > 0:
            self._last_qos1 = info
        if timeout is not None:
            self._await(info, time.monotonic() + timeout, f"the message to {topic!r}", timeout)
        return info

    def publish_many(
        self, topic: str, payloads: Iterable[bytes], *, qos: int = 1, window: int = 16, timeout: float = 120.0
    ) -> int:
        """Publish a stream with at most ``window`` messages awaiting PUBACK; return the count, LinkError on timeout."""
        deadline = time.monotonic() + timeout
        pending: deque[mqtt.MQTTMessageInfo] = deque()
        count = 0
        for payload in payloads:
            if len(pending) >= window:
                self._await(pending.popleft(), deadline, f"a message to {topic!r}", timeout)
            pending.append(self.publish(topic, payload, qos=qos))
            count += 1
        while pending:
            self._await(pending.popleft(), deadline, f"a message to {topic!r}", timeout)
        return count

    def _await(self, info: mqtt.MQTTMessageInfo, deadline: float, what: str, timeout: float) -> None:
        if getattr(self._handler_thread, "active", False):
            # The PUBACK would be read by this very thread: waiting here would always time out.
            raise RuntimeError(
                "a handler cannot wait for a PUBACK; publish without timeout or hand the work to another thread"
            )
        if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            # paho queued it and sends it after reconnecting, but wait_for_publish() refuses NO_CONN outright;
            # AGAIN makes it wait for the PUBACK like any other message.
            info.rc = MQTTErrorCode.MQTT_ERR_AGAIN
        try:
            info.wait_for_publish(max(0.0, deadline - time.monotonic()))
            published = info.is_published()
        except (RuntimeError, ValueError) as exc:
            raise LinkError(f"publishing {what} failed: {exc}") from None
        if not published:
            state = "connected" if self.connected else "disconnected, reconnecting"
            raise LinkError(f"MQTT broker at {self.address} did not acknowledge {what} within {timeout:g} s ({state})")

    # --- shutdown --------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Publish the retained offline status, wait for pending PUBACKs, disconnect cleanly and stop paho's thread."""
        if self._closing:
            return
        self._closing = True
        if self._started and self.connected:
            try:
                if self.presence is not None:
                    offline = dataclasses.replace(self.presence, state="offline", msg_id=new_msg_id())
                    self.publish(self.status_topic, offline.encode(), retain=True)  # type: ignore[arg-type]
                # The broker acknowledges QoS 1 messages in order (MQTT 3.1.1 §4.6): after the last PUBACK none is in
                # flight; messages still queued behind paho's in-flight window would be dropped at DISCONNECT.
                if self._last_qos1 is not None:
                    self._await(
                        self._last_qos1, time.monotonic() + timeout, "the messages published before closing", timeout
                    )
            except LinkError as exc:
                log.warning("closing before the MQTT broker acknowledged every message: %s", exc)
        self._client.disconnect()
        if self._started:
            self._client.loop_stop()
        self._connected.clear()

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_delay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """No Nagle delay on the broker connection: a small packet (an announcement, a PUBACK awaited before the next payload)
    would otherwise wait for the ACK of the previous one, up to the peer's delayed-ACK time (40 ms on Linux)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # not a TCP socket (e.g. a test double): nothing to tune
        pass


def _status_topic(presence: Presence) -> str:
    topics = Topics(presence.federation)
    return topics.server_status if presence.role == "server" else topics.status(presence.device)
