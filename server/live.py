"""What ``feast-server run --dashboard`` shows: the fleet, the round in flight, what was learned, traffic, models.

The server's run thread tells a :class:`LiveView` what happens (a round starts,
a payload is routed, a transfer moves, an update is accepted or refused, a
round ends, models are exported); the view keeps it in a
``feast_edge.dashboard.DashboardState``, which the web thread only reads.
Nothing here touches a tensor or a secret: names, sizes, states and numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from feast_edge.cache.variants import VariantCache
from feast_edge.dashboard.state import DashboardState
from feast_edge.privacy.private_rounds import privacy_entry
from feast_edge.report.model_words import (
    device_calibrated,
    model_accuracy,
    served_so_far,
    validated_on,
    validation_words,
)
from feast_edge.route.payload import bytes_per_param
from feast_edge.route.plans import plan_client
from feast_edge.run.clock import clock_entry
from feast_edge.run.loop import RoundRecord
from feast_edge.server.registry import Device, Registry
from feast_edge.space.preset import Preset
from feast_edge.transport.chunks import Reassembler
from feast_edge.versions.book import Running

REFRESH_S = 1.0  # the fleet table is re-read from the registry at most this often


def _broadcast(record: RoundRecord) -> int:
    """Bytes a float32 broadcast of the full supernet to the round's cohort would have sent (older records: from params)."""
    return record.full_bytes or record.full_params * bytes_per_param("float32")


def hardware_of(profile: Mapping[str, Any]) -> str | None:
    """One line for a device's hardware from the profile it registered with (GPU name, else CPU)."""
    hardware = profile.get("hardware")
    if not isinstance(hardware, Mapping):
        return None
    for key in ("cuda_name", "cpu", "machine"):
        value = hardware.get(key)
        if isinstance(value, str) and value:
            return value
    return None


SETTLED = ("aggregated", "rejected", "declined", "incomplete", "late", "dropped")  # a member's outcome in a step


class LiveView:
    """Feeds a dashboard from the server's run thread (see the module docstring)."""

    def __init__(
        self,
        state: DashboardState,
        preset: Preset,
        cache: VariantCache,
        registry: Registry,
        *,
        rounds: int,
        federation: str,
        payload_dtype: str = "float32",
        validation: str | None = None,
    ) -> None:
        """``validation``: where the run validates, "server" (its --data) or "devices" (federated)."""
        self.state, self.preset, self.cache, self.registry = state, preset, cache, registry
        self.bytes_per_param = bytes_per_param(
            payload_dtype
        )  # a routed envelope's size before the first payload is encoded
        self._served: dict[
            int, tuple[dict[str, Any], dict[str, Any]]
        ] = {}  # budget -> (variant, envelope) of that budget
        self._last_refresh = float("-inf")
        # The served version each device runs (server.versions): set by the server once its registry is open.
        self.versions: Callable[[], Mapping[str, Running]] | None = None
        self._round: int | None = None
        self._traffic: dict[str, dict[str, int]] = {}  # device -> bytes down/up in the round in flight
        self._members: dict[str, str] = {}  # device -> its state in the round in flight
        self._uploads: dict[str, int] = {}  # device -> chunks of its upload last shown
        self._probes: list[dict[str, Any]] = []  # the latest validation's points (accuracy vs MACs)
        state.set_run(
            federation=federation,
            preset=preset.name,
            method="feast",
            rounds_total=rounds or None,  # None: no end (--continuous)
            rounds_done=0,
            status="waiting",
            started=time.time(),
            validation=None if validation is None else validation_words({"source": validation}),
            server_data=None if validation is None else validation != "devices",
        )

    # ------------------------------------------------------------------ fleet
    def _variant(self, budget: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The variant a device of ``budget`` is served and its routed envelope (cached per budget)."""
        if budget not in self._served:
            if not self.cache.affordable(budget):
                return None
            entry = self.cache.largest_affordable(budget)
            params = plan_client(self.cache, budget).envelope.params(self.preset)
            self._served[budget] = (
                {"label": f"{entry.macs / 1e6:.2f}M", "macs": entry.macs, "params": entry.params},
                {"params": params, "bytes": params * self.bytes_per_param},
            )
        return self._served[budget]

    def _device_fields(self, device: Device, hosts_online: set[str]) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "profile": device.profile.get("name") if isinstance(device.profile.get("name"), str) else None,
            "hardware": hardware_of(device.profile),
            "budget_macs": device.budget_macs,
            "precision": device.precision,
            "samples": device.samples,
            "online": device.host in hosts_online,
            "last_seen": device.last_seen,
            "rounds": device.rounds,
        }
        served = self._variant(device.budget_macs)
        if served is not None:
            fields["variant"], envelope = served
            fields.setdefault("envelope", envelope)
        return fields

    def refresh(self, hosts_online: Iterable[str], *, force: bool = False) -> None:
        """Re-read the registry into the fleet table (at most every REFRESH_S unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_refresh < REFRESH_S:
            return
        self._last_refresh = now
        online = set(hosts_online)
        running = {} if self.versions is None else self.versions()
        for device in self.registry.devices():
            fields = self._device_fields(device, online)
            if device.device_id in running:
                fields["version"] = running[device.device_id].to_dict()
            self.state.set_device(device.device_id, **fields)

    def tick(self, hosts_online: Iterable[str], uploads: Reassembler | None) -> None:
        """From the server's pump: the fleet table, and how far the cohort's uploads have come (chunks the server holds)."""
        self.refresh(hosts_online)
        if uploads is None or self._round is None:
            return
        for info in uploads.active():
            received = uploads.received(info.transfer)
            if info.round == self._round and received is not None:
                self.upload_progress(info.device, received, info.count)

    # ------------------------------------------------------------------ the round in flight
    def round_started(self, t: int, cohort: Sequence[str], timeout: float) -> None:
        self._round, self._traffic, self._uploads = t, {d: {"down": 0, "up": 0} for d in cohort}, {}
        self._members = {d: "routed" for d in cohort}
        self.state.set_run(status="running")
        self.state.start_round(t + 1, list(cohort), time.time() + timeout)

    def jobs_started(self, t: int, devices: Sequence[str], timeout: float) -> None:
        """Asynchronous rounds: ``devices`` were drawn into free slots at version ``t``; the step in flight shows every
        job since the last release (the earlier ones keep their state)."""
        kept = {d: m for d, m in self._members.items() if self._round is not None or m not in SETTLED}  # a release
        members = {**kept, **dict.fromkeys(devices, "routed")}
        traffic = {
            **{d: self._traffic.get(d, {"down": 0, "up": 0}) for d in kept},
            **{d: {"down": 0, "up": 0} for d in devices},
        }
        self.round_started(t, list(members), timeout)
        self._members, self._traffic = members, traffic
        for device, state in members.items():
            if state != "routed":
                self.state.member(device, state)
        for device in devices:
            self.state.set_device(device, job={"version": t, "since": time.time()})

    def buffer(self, held: int, size: int, in_flight: Mapping[str, int]) -> None:
        """Asynchronous rounds: ``held`` of the ``size`` updates a release needs are buffered; the jobs in flight
        (device -> the version it trains from)."""
        self.state.set_run(buffer={"held": held, "size": size, "in_flight": dict(sorted(in_flight.items()))})

    def secure_stage(self, stage: str, detail: str) -> None:
        """Secure aggregation's stage in the round in flight (keys, shares, masking, unmask, done or failed)."""
        self.state.set_run(secure={"round": None if self._round is None else self._round + 1, "stage": stage,
                                   "detail": detail})  # fmt: skip

    def routed(self, device: str, size: int, chunks: int, params: int) -> None:
        """``device``'s routed payload (``size`` bytes in ``chunks`` chunks) was announced and sent."""
        self._traffic.setdefault(device, {"down": 0, "up": 0})["down"] = size
        self.state.set_device(device, envelope={"params": params, "bytes": size})
        self.member(device, "routed", 0, chunks)

    def member(
        self, device: str, state: str, done: int | None = None, total: int | None = None, reason: str | None = None
    ) -> None:
        if device not in self._members:
            return
        final = self._members[device] in SETTLED
        if final and state not in ("aggregated",):
            return  # a settled member keeps its outcome (e.g. a late progress report after a rejection)
        self._members[device] = state
        self.state.member(device, state, done=done, total=total, reason=reason)

    def device_progress(self, device: str, values: Mapping[str, Any]) -> None:
        """A cohort device's own report of where it is (``phase`` downloading/training/uploading, ``done``/``total`` chunks)."""
        phase, current = values.get("phase"), self._members.get(device)
        if (
            phase not in ("downloading", "training", "masking", "uploading")
            or current is None
            or values.get("round") != self._round
        ):
            return
        if current == "uploading" and phase != "uploading":
            return  # the server's own upload count is newer than a device's earlier phase
        done, total = values.get("done"), values.get("total")
        counts = [
            v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1_000_000 else None for v in (done, total)
        ]
        self.member(device, phase, *counts)

    def upload_progress(self, device: str, received: int, total: int) -> None:
        """Chunks of ``device``'s upload received by the server so far."""
        if self._uploads.get(device) != received and self._members.get(device) in (
            "routed",
            "downloading",
            "training",
            "uploading",
        ):
            self._uploads[device] = received
            self.member(device, "uploading", received, total)

    def upload_done(self, device: str, size: int, chunks: int) -> None:
        """``device``'s whole upload (``size`` bytes, ``chunks`` chunks) is in and valid; it waits for the aggregation."""
        self._traffic.setdefault(device, {"down": 0, "up": 0})["up"] = size
        self.member(device, "uploading", chunks, chunks)

    def round_finished(self, record: RoundRecord, probes: Sequence[Mapping[str, Any]] | None = None) -> None:
        """The round's outcome: member states, one history entry, the latest validation points."""
        for device in record.updated:
            self.member(
                device,
                "aggregated" if record.applied else "late",
                reason=None if record.applied else "too few updates: the model stayed unchanged",
            )
        unsettled = {"rejected": record.rejected, "declined": record.declined, "incomplete": record.incomplete}
        for outcome, reasons in unsettled.items():
            for device, reason in reasons.items():
                self.member(device, outcome, reason=reason)
        for device in record.missing:
            self.member(device, "late", reason="no update by the deadline")
        for device in record.dropped:
            self.member(device, "dropped", reason="went offline during the round")
        for device in record.cohort:
            outcome = (
                ("accepted", None)
                if device in record.updated
                else next(((k, r[device]) for k, r in unsettled.items() if device in r), None)
                or (("dropped", "went offline") if device in record.dropped else ("late", "no update by the deadline"))
            )
            upload = {"round": record.round, "status": outcome[0], "reason": outcome[1]}
            if device in record.staleness:  # an asynchronous release: how many releases its update lagged
                upload["staleness"] = record.staleness[device]
            self.state.set_device(device, last_upload=upload)
        down = sum(t["down"] for t in self._traffic.values())
        up = sum(t["up"] for t in self._traffic.values())
        self.state.end_round(
            {
                "round": record.round,
                "loss": record.loss,
                "val_accuracy": record.val_accuracy,
                "population_accuracy": None,
                "bytes_down": down,
                "bytes_up": up,
                "broadcast_bytes": _broadcast(record),
                "train_macs": record.train_macs,
                "seconds": record.seconds,
                "devices": {d: dict(t) for d, t in self._traffic.items()},
                "validated_on": self._validated_on(record),
                **privacy_entry(record.dp),
                **clock_entry(record.clock, record.staleness),
            }
        )
        if probes:
            self._probes = [dict(p) for p in probes]
            self.state.set_variants(self._probes)
        self.state.set_served(served_so_far(record.validation))
        self.state.set_run(rounds_done=record.round)
        self._round = None

    def _validated_on(self, record: RoundRecord) -> dict[str, Any] | None:
        """Where ``record``'s round was validated; a validated round also updates the run's line of where that is."""
        where = validated_on(record.val_accuracy, record.validation)
        if where is not None:
            self.state.set_run(validation=validation_words(where))
        return where

    def resumed(self, history: Sequence[RoundRecord]) -> None:
        """The rounds a resumed run completed before (their per-device traffic was not kept)."""
        for record in history:
            self.state.end_round(
                {
                    "round": record.round,
                    "loss": record.loss,
                    "val_accuracy": record.val_accuracy,
                    "population_accuracy": None,
                    "bytes_down": None,
                    "bytes_up": None,
                    "broadcast_bytes": _broadcast(record),
                    "train_macs": record.train_macs,
                    "seconds": record.seconds,
                    "devices": {},
                    "validated_on": self._validated_on(record),
                }
            )
        if history:
            self.state.set_run(rounds_done=history[-1].round)

    # ------------------------------------------------------------------ end of the run
    def finished(self, status: str, message: str | None = None) -> None:
        self.state.set_run(status=status, **({"message": message} if message else {}))

    def models(
        self,
        manifests: Sequence[Mapping[str, Any]],
        model_dir: Path,
        reports: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """The exported ONNX models (served for download), or without server data the models each device calibrates
        (``reports``: what each device reported of its model, its held-out accuracy and its personal model's, which
        the state sums up as the means and the worst of each). Their accuracy gives the population accuracy (the mean
        over devices of the model each is served); a server-validated one also joins the accuracy-vs-MACs points."""
        self.state.set_models([dict(m) for m in manifests], model_dir, reports)
        accuracies = [model_accuracy(m, (reports or {}).get(str(m.get("device"))))["accuracy"] for m in manifests]
        if accuracies and all(isinstance(a, (int, float)) for a in accuracies):
            self.state.set_population(sum(accuracies) / len(accuracies))
        points = {int(p["macs"]): dict(p) for p in self._probes}
        for m in manifests:
            if isinstance(m.get("macs"), int) and not device_calibrated(m):
                label = f"{m['macs'] / 1e6:.2f}M"
                points[m["macs"]] = {
                    "label": label,
                    "macs": m["macs"],
                    "params": m.get("params"),
                    "val_accuracy": m.get("validation_accuracy"),
                    "test_accuracy": None,
                }
        if points:
            self.state.set_variants([points[macs] for macs in sorted(points)])
