"""The server's inbox: messages parsed in paho's thread, waiting for the run thread, fair per device."""

from __future__ import annotations

import logging
import queue
import threading

from feast_edge.protocol import Metrics
from feast_edge.transport.messages import Message
from feast_edge.transport.throttle import Throttle

log = logging.getLogger(__name__)

PER_DEVICE_QUEUE = 256  # messages one device may have waiting in the server's inbox
INBOX_SIZE = 100_000


class Inbox:
    """A bounded queue where one device's flood never delays (or crowds out) another device's update.

    Each device may have ``per_device`` messages waiting; beyond that its messages are dropped (and logged, a
    few lines a minute). Metrics only ever count as their latest: any number of them waits as one.
    """

    def __init__(self, per_device: int = PER_DEVICE_QUEUE, size: int = INBOX_SIZE) -> None:
        self.per_device = per_device
        self._queue: queue.Queue[tuple[str, Message]] = queue.Queue(maxsize=size)
        self._lock = threading.Lock()
        self._queued: dict[str, int] = {}  # device -> its messages in the inbox
        self._latest_metrics: dict[str, Metrics] = {}  # device -> its newest metrics, waiting to be handled
        self._dropped = Throttle(log)

    def qsize(self) -> int:
        return self._queue.qsize()

    def put(self, channel: str, message: Message) -> None:
        """Queue ``message`` (from paho's thread), or drop it when its device has its share waiting."""
        device = message.device
        with self._lock:
            if isinstance(message, Metrics):
                waiting = device in self._latest_metrics
                self._latest_metrics[device] = message
                if waiting:
                    return
            if self._queued.get(device, 0) >= self.per_device:
                self._dropped.warning(
                    f"queue {device}",
                    "%s has %d messages waiting; dropped its %s",
                    device,
                    self.per_device,
                    message.kind,
                )
                return
            self._queued[device] = self._queued.get(device, 0) + 1
        try:
            self._queue.put_nowait((channel, message))
        except queue.Full:
            self._taken(message)
            self._dropped.warning(
                f"inbox {message.kind}", "server inbox full; dropped a %s message from %s", message.kind, device
            )

    def get(self, timeout: float) -> tuple[str, Message] | None:
        """The next (channel, message) within ``timeout`` seconds (0: only what is queued now), or None."""
        try:
            channel, message = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        return channel, self._taken(message)

    def _taken(self, message: Message) -> Message:
        """The message to handle for one taken from the queue (for metrics, the device's latest)."""
        with self._lock:
            left = self._queued.get(message.device, 1) - 1
            if left > 0:
                self._queued[message.device] = left
            else:
                self._queued.pop(message.device, None)
            if isinstance(message, Metrics):
                return self._latest_metrics.pop(message.device, message)
        return message
