"""Handing devices their models: push each exported ONNX file after the run, answer ``fetch-model`` requests.

Models are exported by ``export.py`` into ``<out>/models``; this module sends
them: a ``ModelReady`` message naming the transfer (or saying why there is no
model), then the file's chunks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError
from feast_edge.protocol import Finished, ModelReady
from feast_edge.server.export import read_device_model
from feast_edge.transport.errors import LinkError
from feast_edge.transport.link import Link
from feast_edge.transport.throttle import Throttle
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkSender

log = logging.getLogger(__name__)


REQUEST_INTERVAL = 5.0  # seconds: a device's model requests closer together than this are dropped


class ModelServer:
    """Sends devices the models exported in ``out``.

    However often a device asks, it costs at most one held copy of its model (a new send supersedes the
    unacknowledged one) and one send every ``REQUEST_INTERVAL`` seconds; requests in between wait.
    """

    def __init__(self, out: Path, link: Link, topics: Topics, sender: ChunkSender, send_timeout: float) -> None:
        self.out, self.link, self.topics, self.sender, self.send_timeout = out, link, topics, sender, send_timeout
        self._held: dict[str, str] = {}  # device -> its model transfer awaiting a receipt
        self._asked: dict[str, float] = {}  # device -> when its last request was answered
        self._waiting: dict[str, str] = {}  # device -> its latest request not answered yet
        self._dropped = Throttle(log)

    def request(self, device: str, request: str) -> None:
        """Answer a ``fetch-model`` request now, or, if the device was answered less than ``REQUEST_INTERVAL`` seconds
        ago, once that interval is over (a device's waiting requests are answered once, by its latest)."""
        if len(self._waiting) >= 4096 and device not in self._waiting:
            self._dropped.warning(
                "requests", "dropped a model request of %s: 4096 devices are waiting for theirs", device
            )
            return
        self._waiting[device] = request
        self.tick()

    def tick(self) -> None:
        """Answer the waiting requests whose device's interval is over."""
        now = time.monotonic()
        for device in [d for d in self._waiting if now - self._asked.get(d, float("-inf")) >= REQUEST_INTERVAL]:
            self._asked[device] = now
            self.send(device, self._waiting.pop(device))
        if len(self._asked) > 4096:  # forget who asked long ago: the record stays bounded whatever ids ask
            self._asked = {d: t for d, t in self._asked.items() if now - t < REQUEST_INTERVAL}

    def send(self, device: str, request: str = "") -> bool:
        """Send ``device`` its exported model, or tell it why there is none; True when a model was sent."""
        try:
            found = read_device_model(self.out, device)
        except FeastError as exc:
            found, reason = None, str(exc)
        else:
            reason = f"no model has been exported for device {device!r} yet; models are exported once a round is served (or by 'feast-server export')"
        base = {"federation": self.topics.federation, "round": 0, "device": device, "request": request}
        if found is None:
            self.link.publish(self.topics.ctrl(device), ModelReady(**base, available=False, reason=reason).encode())
            log.info("model request of %s: %s", device, reason)
            return False
        blob, manifest = found
        superseded = self._held.pop(device, None)
        if superseded is not None:
            self.sender.outbox.release(superseded)
        info = self.sender.describe(blob, round=0, device=device)
        announcement = ModelReady(**base, transfer=info.to_dict(), manifest=manifest).encode()
        try:
            self.sender.announce_and_send(self.topics.ctrl(device), announcement, blob, info, timeout=self.send_timeout)
        except LinkError as exc:
            log.warning("could not send the model of %s: %s", device, exc)
            return False
        self._held[device] = info.transfer
        log.info("sent %s its model %s (%.2f MB)", device, manifest.get("file"), len(blob) / 1e6)
        return True

    def push(self, manifests: Iterable[dict[str, Any]], online: Iterable[str]) -> list[str]:
        """Send each online device its model; returns the devices served."""
        here = set(online)
        return [m["device"] for m in manifests if m["device"] in here and self.send(m["device"])]

    def finish(self, devices: Iterable[tuple[str, str]], rounds: int, completed: int, exported: Iterable[str]) -> None:
        """Tell ``devices`` ((device id, its agent's instance)) the federation is over (their agents exit unless started
        with --stay)."""
        with_model = set(exported)
        for device, instance in devices:
            message = Finished(
                federation=self.topics.federation,
                round=0,
                device=device,
                rounds=rounds,
                completed=completed,
                instance=instance,
                model=device in with_model,
            )
            self.link.publish(self.topics.ctrl(device), message.encode())
