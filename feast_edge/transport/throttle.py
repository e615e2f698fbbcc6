"""Rate-limited logging of dropped network input: a flood of bad messages must not become a flood of log lines."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict


def channel_of(topic: str) -> str:
    """A topic without its last level (``feast/lab/events/jet`` -> ``feast/lab/events``): a throttle key that stays
    one key however many device ids a flood uses."""
    return topic.rsplit("/", 1)[0]


class Throttle:
    """At most ``burst`` lines per key every ``period`` seconds; the rest are counted and summed up in the next line."""

    def __init__(self, logger: logging.Logger, *, period: float = 60.0, burst: int = 5, keys: int = 1024) -> None:
        self.logger = logger
        self.period = period
        self.burst = burst
        self._keys = keys  # remembered keys; the oldest is forgotten first, so memory stays bounded whatever arrives
        self._windows: OrderedDict[str, list[float | int]] = (
            OrderedDict()
        )  # key -> [window start, lines logged, suppressed]
        self._lock = threading.Lock()

    def log(self, level: int, key: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``key`` used up its lines in this period; True when it was logged."""
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window[0] >= self.period:
                suppressed = int(window[2]) if window is not None else 0
                window = self._windows[key] = [now, 0, 0]
                if suppressed:
                    message = f"{message} ({suppressed} more like this in the last {self.period:g} s were not logged)"
            self._windows.move_to_end(key)
            if len(self._windows) > self._keys:
                self._windows.popitem(last=False)
            if window[1] >= self.burst:
                window[2] += 1
                return False
            window[1] += 1
        self.logger.log(level, message, *args)
        return True

    def warning(self, key: str, message: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, message, *args)
