"""Retained messages a finished federation left on a broker (its presences), removed: ``clear_retained``."""

from __future__ import annotations

import threading
import time
from typing import Any

from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.link import Link


def clear_retained(config: LinkConfig, topic_filter: str, settle: float = 0.5) -> int:
    """Remove every retained message under ``topic_filter`` (e.g. ``feast/<federation>/#``); returns how many there were.

    The broker sends a subscription's retained messages before any message published after it on the same connection,
    so for a filter ending in ``#`` a non-retained marker published under it marks the end of them (its echo ends the
    wait; other subscribers of the filter see one message on ``<prefix>/clear-retained``). Without the marker's echo,
    or for another filter, the wait is ``settle`` seconds.
    """
    link = Link(config)
    topics: set[str] = set()
    marker = topic_filter[:-1] + "clear-retained" if topic_filter.endswith("#") else None
    echoed = threading.Event()

    def seen(record: Any) -> None:
        if record.topic == marker:
            echoed.set()
        elif record.retain and record.payload:
            topics.add(record.topic)

    link.subscribe(topic_filter, seen)
    link.connect(timeout=5)
    try:
        if marker is not None:
            link.publish(marker, b"", timeout=5)
        echoed.wait(settle) if marker is not None else time.sleep(settle)
        for topic in sorted(topics):
            link.publish(topic, b"", retain=True, timeout=5)
    finally:
        link.close()
    return len(topics)
