"""Handing devices their models: push each exported ONNX file after the run, answer ``fetch-model`` requests.

Models are exported by ``export.py`` into ``<out>/models``; this module sends
them: a ``ModelReady`` message naming the transfer (or saying why there is no
model), then the file's chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError
from feast_edge.protocol import Finished, ModelReady
from feast_edge.server.export import read_device_model
from feast_edge.transport.errors import LinkError
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkSender

log = logging.getLogger(__name__)


class ModelServer:
    """Sends devices the models exported in ``out``."""

    def __init__(self, out: Path, link: Link, topics: Topics, sender: ChunkSender, send_timeout: float) -> None:
        self.out, self.link, self.topics, self.sender, self.send_timeout = out, link, topics, sender, send_timeout

    def send(self, device: str, request: str = "") -> bool:
        """Send ``device`` its exported model, or tell it why there is none; True when a model was sent."""
        try:
            found = read_device_model(self.out, device)
        except FeastError as exc:
            found, reason = None, str(exc)
        else:
            reason = f"no model has been exported for device {device!r} yet; models are exported after the last round (or by 'feast-server export')"
        base = {"federation": self.topics.federation, "round": 0, "device": device, "request": request}
        if found is None:
            self.link.publish(self.topics.ctrl(device), ModelReady(**base, available=False, reason=reason).encode())
            log.info("model request of %s: %s", device, reason)
            return False
        blob, manifest = found
        info = self.sender.describe(blob, round=0, device=device)
        announcement = ModelReady(**base, transfer=info.to_dict(), manifest=manifest).encode()
        try:
            self.sender.announce_and_send(self.topics.ctrl(device), announcement, blob, info, timeout=self.send_timeout)
        except LinkError as exc:
            log.warning("could not send the model of %s: %s", device, exc)
            return False
        log.info("sent %s its model %s (%.2f MB)", device, manifest.get("file"), len(blob) / 1e6)
        return True

    def push(self, manifests: Iterable[dict[str, Any]], online: Iterable[str]) -> list[str]:
        """Send each online device its model; returns the devices served."""
        here = set(online)
        return [m["device"] for m in manifests if m["device"] in here and self.send(m["device"])]

    def finish(self, devices: Iterable[str], rounds: int, completed: int, exported: Iterable[str]) -> None:
        """Tell ``devices`` the federation is over (their agents exit unless started with --stay)."""
        with_model = set(exported)
        for device in devices:
            message = Finished(federation=self.topics.federation, round=0, device=device, rounds=rounds, completed=completed, model=device in with_model)
            self.link.publish(self.topics.ctrl(device), message.encode())
