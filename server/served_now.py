"""The served model, exported when it is chosen: late joiners and ``fetch-model`` get it during the run.

    after each round      if the served round changed (feast_edge.evaluate.served_round), every registered device's
                          model is exported into ``<out>/models`` at once (each device calibrates its variant's BN on
                          its own data; the export after the last round combines the devices' statistics where
                          --bn-calibration federated says so), and ``feast-agent fetch-model`` answers with it
    pushed to             each online device that has no model of this run yet, once: in a finite run the devices that
                          were not registered when this server's first round ended (late joiners), without an end
                          (--continuous) every device; within one round of joining, once a round is served

A device present from the start of a finite run gets its model at the end, as before; one that joins later does not
wait for the end; without an end every device gets the first served model, a newer one on request (feast-agent
fetch-model) and at the stop. A push is not free on the device (it calibrates, validates and may personalize the
model before its next round), so newer models are not pushed to every device after each validation: that is for
versions a device can refuse (canaries, install only if better). An export that fails mid-run is logged and retried after the next round: it never stops the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from feast_edge.errors import FeastError
from feast_edge.server.registry import Device

log = logging.getLogger(__name__)


class Serving(Protocol):
    """What the served models need of the server."""

    def export(self, federated_bn: bool | None = None) -> list[dict[str, Any]]: ...

    def announce_models(self, manifests: list[dict[str, Any]]) -> list[str]: ...

    def online_devices(self) -> list[str]: ...


class ServedNow:
    """Exports each newly served round and pushes it to who needs it (see the module docstring)."""

    def __init__(self, server: Serving, devices: Callable[[], list[Device]], *, everyone: bool) -> None:
        """``devices()``: the registered devices; ``everyone``: push the served model to every online device that has
        none (--continuous), else only to late joiners."""
        self.server, self.devices, self.everyone = server, devices, everyone
        self.exported: int | None = None  # the served round models/ holds
        self.manifests: list[dict[str, Any]] = []
        self.pushed: set[str] = set()  # devices sent a model of this run
        self.initial: set[str] | None = None  # the devices registered when this server's first round ended

    def after(self, served: int | None) -> None:
        """After a round, with ``served`` the served round (None: none chosen yet)."""
        if self.initial is None:
            self.initial = {d.device_id for d in self.devices()}
        if served is None:
            return
        wanted = set(self.server.online_devices()) - self.pushed
        if not self.everyone:
            wanted -= self.initial
        # A device that registered after the served round was exported has no model in it yet: export again now.
        if served != self.exported or wanted - {m["device"] for m in self.manifests}:
            began = time.monotonic()
            try:
                manifests = self.server.export(federated_bn=False)
            except FeastError as exc:
                log.warning(
                    "could not export round %d's models during the run (%s); trying after the next round", served, exc
                )
                return
            log.info(
                "exported the served round %d's models for %d devices (%.1f s)",
                served,
                len(manifests),
                time.monotonic() - began,
            )
            self.exported, self.manifests = served, manifests
        if not wanted:
            return
        sent = self.server.announce_models([m for m in self.manifests if m["device"] in wanted])
        self.pushed |= set(sent)
        if sent:
            log.info("sent round %d's models to %s", served, ", ".join(sent))
