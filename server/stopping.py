"""Ending a run on request, after the round in progress: ``feast-server stop --out DIR``, or SIGTERM.

    feast-server stop --out DIR   writes DIR/stop-request.json (atomically: who asked, when, why)
    the server (StopWatch)        sees it within a second, sets the run loop's ``stop`` and the events' ``ending``:
                                  the round in progress finishes and is checkpointed, a wait for devices ends at
                                  once; then the run exports, pushes each device its model and sends ``finished``
                                  (agents exit unless started with --stay), and removes the request
    SIGTERM                       the same; a second SIGTERM (or Ctrl-C) abandons the round in progress instead

The request is a file in the run directory, so it works from any shell that sees the directory, needs no signal
permission and no broker identity, and survives until the server reads it. A request left from before the server
started is removed at start with a log line (it was meant for an earlier process). Nothing is lost by a stop: the run
resumes with the same command, or is extended with a larger --rounds or --continuous (feast_edge.run.store).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from feast_edge.util.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

STOP_FILE = "stop-request.json"
MAX_REQUEST = 4096  # bytes read of a request: anything in the run directory is bounded before use
POLL = 0.5  # seconds between looks for a request


def request_stop(out: Path, reason: str = "") -> Path:
    """Ask the server of the run in ``out`` to end after its round in progress; returns the request's path."""
    path = Path(out) / STOP_FILE
    body = {"requested_at": time.time(), "by": f"{socket.gethostname()} pid {os.getpid()}", "reason": reason[:200]}
    atomic_write_bytes(path, json.dumps(body).encode())
    return path


def read_request(out: Path) -> dict[str, Any] | None:
    """The stop request in ``out`` (None: none); a damaged or oversized one still counts as a request."""
    path = Path(out) / STOP_FILE
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_REQUEST + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return {"reason": f"unreadable request ({exc.strerror})"}
    try:
        body = json.loads(raw) if len(raw) <= MAX_REQUEST else None
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {"reason": "a request that is not a JSON object"}


def clear_request(out: Path) -> None:
    """Remove the stop request in ``out``, if any."""
    try:
        (Path(out) / STOP_FILE).unlink()
    except FileNotFoundError:
        pass


def said(request: dict[str, Any]) -> str:
    """A request in words for the log."""
    by, reason = str(request.get("by", ""))[:80], str(request.get("reason", ""))[:200]
    return " ".join(part for part in (f"by {by}" if by else "", f"({reason})" if reason else "") if part)


class StopWatch:
    """Watches ``out`` for a stop request (and takes SIGTERM's) and sets ``events`` when one comes."""

    def __init__(self, out: Path, *events: threading.Event) -> None:
        self.out, self.events = Path(out), events
        self.requested: str | None = None  # who asked and why, once a stop was requested
        self._done = threading.Event()
        stale = read_request(self.out)
        if stale is not None:
            log.warning("removed a stop request left from before this server started %s", said(stale))
            clear_request(self.out)
        self._thread = threading.Thread(target=self._watch, name="stop-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request(self, words: str) -> None:
        """A stop was requested (``words``: by whom); the round in progress finishes first."""
        if self.requested is None:
            self.requested = words
            log.info("stop requested %s: the run ends after the round in progress, checkpointed", words)
        for event in self.events:
            event.set()

    def _watch(self) -> None:
        while not self._done.wait(POLL):
            request = read_request(self.out)
            if request is not None:
                self.request(said(request) or "by a request file")
                return

    def close(self) -> None:
        """Stop watching; a request that was acted on is removed."""
        self._done.set()
        if self.requested is not None:
            clear_request(self.out)
