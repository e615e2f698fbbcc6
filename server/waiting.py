"""Waiting for enough devices online, saying who is missing (a round's cohort, an asynchronous run's next slot)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from feast_edge.run.release import EndRequested

log = logging.getLogger(__name__)

HEARTBEAT = 10.0  # seconds between "waiting for devices" lines


class WaitTimeout(Exception):
    """Not enough devices came online within ``wait_timeout``."""


class Pump(Protocol):
    """The server's event loop, as far as a wait needs it."""

    stop: threading.Event
    ending: threading.Event  # a stop was requested: a wait for devices ends (EndRequested)

    def pump(self, seconds: float) -> None:
        """Handle incoming messages for ``seconds`` (0: only what is queued now)."""


class Roster(Protocol):
    """Who may be in a cohort (``devices.DeviceBook``)."""

    def online(self) -> list[str]: ...

    def offline(self) -> list[str]: ...


def wait_online(events: Pump, roster: Roster, needed: int, wait_timeout: float | None) -> list[str]:
    """Block until ``needed`` devices of ``roster`` are online, saying who is missing at least every 10 s; WaitTimeout
    past ``wait_timeout`` seconds (None: wait forever), KeyboardInterrupt once ``events.stop`` is set, EndRequested
    once ``events.ending`` is (the run ends before the step that waited, resumable)."""
    start = time.monotonic()
    last_note, last_online = float("-inf"), None
    while not events.stop.is_set():
        if events.ending.is_set():
            raise EndRequested("stopped on request while waiting for devices")
        online = roster.online()
        if len(online) >= needed:
            return online
        now = time.monotonic()
        if online != last_online or now - last_note >= HEARTBEAT:
            offline = roster.offline()
            log.info(
                "waiting for devices: %d of %d online (%s)%s; %.0f s",
                len(online),
                needed,
                ", ".join(online) or "none yet",
                f"; registered but offline: {', '.join(offline)}" if offline else "",
                now - start,
            )
            last_note, last_online = now, online
        if wait_timeout is not None and now - start > wait_timeout:
            raise WaitTimeout(f"only {len(online)} of the {needed} devices needed were online after {wait_timeout:g} s")
        events.pump(0.2)
    raise KeyboardInterrupt
