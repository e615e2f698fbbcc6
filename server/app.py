"""The federation server: one MQTT link, the run loop, and the pieces that each do one job (docs/protocol.md §7).

* ``config.ServerConfig``: the settings, and the fingerprint a resumed run keeps;
* ``devices.DeviceBook``: registrations and presence (who may be in a cohort);
* ``events.Events``: the inbox, each message handed to the piece whose job it is;
* ``exchange.RoundExchange``: one round's messages and payloads down, replies up;
* ``collect.DeviceCollector``: the FEAST part of a round: routed slices out, valid updates back;
* ``host.RunHost`` (what the Flower ServerApp shares): preset, cache, held data, registry, export, and
  ``feast_edge.run.loop.RunLoop``: cohorts, aggregation, checkpoints, resume, validation; the loop
  ``feast-edge simulate`` runs, so round ``t`` here computes exactly what the simulation computes;
* ``export`` / ``serving.ModelServer``: per-device ONNX models, pushed or fetched.

Everything that arrives from the broker is parsed in paho's network thread and
queued; one thread (the caller of :meth:`FederationServer.run`) handles the
queue, so no state is touched from two threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from feast_edge.dashboard.state import DashboardState
from feast_edge.evaluate.served_round import distrusted_in, served_record
from feast_edge.run.checkpoint import read_record
from feast_edge.run.collect import Collector
from feast_edge.run.loop import CHECKPOINT, RoundRecord
from feast_edge.server.bn_calibration import Calibrated, FederatedCalibration
from feast_edge.server.collect import RoundTerms
from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.server.devices import DeviceBook
from feast_edge.server.environment import ServerEnvironment
from feast_edge.server.events import Events
from feast_edge.server.exchange import ExchangeSettings
from feast_edge.server.host import REGISTRY, RunHost
from feast_edge.server.jobs import JobExchange
from feast_edge.server.live import LiveView
from feast_edge.server.registry import Device
from feast_edge.server.serving import ModelServer
from feast_edge.server.stopping import StopWatch
from feast_edge.server.validation import FederatedValidation
from feast_edge.server.versions import Served, ServedVersions, VersionPolicy
from feast_edge.server.waiting import WaitTimeout
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract
from feast_edge.space.supernet import Supernet
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.chunks import Reassembler
from feast_edge.transport.frames import MIN_CHUNK_SIZE
from feast_edge.transport.link import Link
from feast_edge.transport.messages import Presence
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender
from feast_edge.util.cores import Threads
from feast_edge.versions.book import FILENAME as VERSIONS
from feast_edge.versions.book import VersionBook
from feast_edge.versions.gate import REFUSED

log = logging.getLogger(__name__)

OFFLINE_GRACE = (
    5.0  # seconds a served device may be offline (a report may still be on its way) before it is not awaited
)

SERVER_ID = "server"

__all__ = ["CHECKPOINT", "REGISTRY", "FederationServer", "RoundRecord", "ServerConfig", "ServerError"]


class FederationServer(RunHost):
    """Runs a federation over one MQTT link; see the module docstring."""

    def __init__(
        self,
        config: ServerConfig,
        link_config: LinkConfig,
        *,
        on_round: Callable[[RoundRecord, int], None] | None = None,
        dashboard: DashboardState | None = None,
        threads: Threads | None = None,
    ) -> None:
        """``threads``: PyTorch's threads for the server's own computing (aggregation, validation, export), chosen
        before each step (``feast-server run --threads``; None leaves them as they are)."""
        super().__init__(config, on_round=on_round)
        self.threads = threads
        self.topics = Topics(config.federation)
        presence = Presence(federation=config.federation, round=0, device=SERVER_ID, state="online", role="server")
        self.link = Link(link_config, presence=presence, on_reconnect=lambda: self.events.reconnected(presence))
        self.devices = DeviceBook(
            self.registry,
            self.preset,
            self.cache,
            federation=config.federation,
            rounds=config.training.horizon or 0,
            reply=lambda device, message: self.link.publish(self.topics.ctrl(device), message.encode()),
            authenticated=link_config.credentials is not None,
            max_samples=config.population.max_samples,
            max_devices=config.population.max_devices,
            shard_samples=None if self.data is None else self.data.shard_samples,
            validation=self.validation_source,
        )
        self.live = (
            None
            if dashboard is None
            else LiveView(
                dashboard,
                self.preset,
                self.cache,
                self.registry,
                rounds=config.training.horizon or 0,
                federation=config.federation,
                payload_dtype=config.aggregation.payload_dtype,
                validation=self.validation_source,
            )
        )
        self.events = Events(self.topics, self.devices, self.live)
        self.stopwatch: StopWatch | None = None  # while the rounds run: a stop request ends them (server.stopping)
        self.inbox, self.stop = self.events.inbox, self.events.stop
        self._wire()
        self.compose_loop(self.environment)

    def _wire(self) -> None:
        """The exchange and what talks through it (model pushes, federated validation and BN statistics), and the
        environment the run loop is composed with (server.environment)."""
        cfg, t, events = self.config, self.topics, self.events
        sender = ChunkSender(self.link, t, "down", chunk_size=cfg.network.chunk_size)
        # Uploads are taken only when announced by a cohort device's update (which also bounds their size): nothing a
        # stranger sends on xfer/up allocates anything here.
        # Every cohort device (asynchronous rounds: every slot) may upload at once, one announced upload each: the
        # reassembler's transfer cap grows with them.
        reassembler = Reassembler(
            federation=cfg.federation,
            max_chunk_size=cfg.network.chunk_size,
            min_chunk_size=MIN_CHUNK_SIZE,
            expected_only=True,
            max_transfers=max(32, cfg.population.per_round, cfg.schedule.concurrency),
        )
        receiver = ChunkReceiver(self.link, t, "up", reassembler=reassembler)
        waits = ExchangeSettings(
            rounds=cfg.training.horizon or 0,
            round_timeout=cfg.network.round_timeout,
            send_timeout=cfg.network.send_timeout,
            wait_timeout=cfg.network.wait_timeout or None,
        )
        events.exchange = JobExchange(t, sender, receiver, events, waits)
        terms = RoundTerms(
            self.preset,
            cfg.train_config(),
            cfg.seed,
            cfg.training.horizon or 0,
            payload_dtype=cfg.aggregation.payload_dtype,
            max_update_norm=cfg.aggregation.max_update_norm,
            local_dp=cfg.local_dp(),
        )
        self.environment = ServerEnvironment(self, terms)
        self.models = events.models = ModelServer(self.out, self.link, t, sender, cfg.network.send_timeout)
        self.book = VersionBook(self.out / VERSIONS)
        policy = VersionPolicy(
            share=cfg.serving.canary,
            seed=cfg.seed,
            wait=cfg.network.round_timeout,
            figures=cfg.federated_statistics,
            everyone=cfg.training.continuous,
        )
        self.versions = events.versions = ServedVersions(
            self, self.book, self.registry.devices, self.devices.supports, self._distrusted, policy,
            lambda: self.served_digest,
        )  # fmt: skip
        if self.live is not None:
            self.live.versions = self.book.running
        self.federated = FederatedValidation(
            events.exchange,
            self.devices,
            self.preset,
            self.cache,
            self.model.state_dict(),
            probes=cfg.validation.probe_variants,
            calibration=cfg.validation.calib_samples,
            payload_dtype=cfg.aggregation.payload_dtype,
            rule=cfg.validation.val_rule,
            max_weight_ratio=cfg.aggregation.max_weight_ratio,
            trained=self.trained_so_far,
        )
        self.calibration = FederatedCalibration(
            events.exchange,
            self.devices,
            self.preset,
            self.cache,
            calibration=cfg.validation.calib_samples,
            payload_dtype=cfg.aggregation.payload_dtype,
            rule=cfg.validation.bn_rule,
            max_weight_ratio=cfg.aggregation.max_weight_ratio,
        )

    @property
    def collector(self) -> Collector | None:
        """How a cohort's updates come back: the devices' collector, wrapped in secure sums under --secure-agg."""
        return self.loop.collector

    def validate_on_devices(
        self, t: int, record: RoundRecord, alternative: Mapping[str, torch.Tensor] | None = None
    ) -> float | None:
        """Round ``t``'s model validated by the devices on their held-out data (server.validation)."""
        return self.federated(t, record, alternative)

    def _validated_points(self) -> list[dict[str, Any]] | None:
        """The last validation's probe points (label, macs, params, val_accuracy): the devices' or the server's."""
        if self.data is None:
            return None if self.federated is None else self.federated.validated
        return getattr(self.loop.method, "validated", None)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> None:
        """Connect to the broker and subscribe; raises a LinkError that says how to fix the connection."""
        cfg, t, events = self.config, self.topics, self.events
        self.link.connect(timeout=timeout)
        # Presence first: retained statuses then arrive before any registration that follows.
        self.link.subscribe(t.status("+"), events.on_message("status"))
        self.link.subscribe(t.register("+"), events.on_message("register"))
        self.link.subscribe(t.events("+"), events.on_message("events"))
        log.info(
            "connected to %s as federation %r; preset %s, %d cached variants; server optimizer %s",
            self.link.address,
            cfg.federation,
            self.preset.name,
            len(self.cache),
            self.loop.settings.server_opt.describe(),
        )

    def close(self) -> None:
        """Publish the offline status and disconnect."""
        self.link.close()
        self.registry.close()
        self.book.close()

    def pump(self, seconds: float) -> None:
        """Handle incoming messages and finished transfers for ``seconds`` (0: only what is queued now)."""
        self.events.pump(seconds)

    def online_devices(self) -> list[str]:
        """Registered devices whose host is online, sorted."""
        return self.devices.online()

    # ------------------------------------------------------------------ the whole run
    def run(self, resume_previous: bool = False, tensorboard: bool = False) -> list[RoundRecord]:
        """Resume if possible, run the remaining rounds, checkpoint each (and ``rounds.csv``, TensorBoard scalars); returns the history."""
        cfg = self.config
        if self.data is None and not cfg.federated_statistics:
            log.info(
                "no --data, and under differential privacy the devices' held-out accuracy counts and BN statistics "
                "would leave them unnoised: no federated validation (the last round is served, each device its "
                "largest affordable variant) and every served model's BN statistics are calibrated on its device's "
                "own data (docs/privacy.md)"
            )
        elif self.data is None:
            log.info(
                "no --data: the devices validate the model on their held-out data every %d rounds; their served "
                "models' BN statistics are %s",
                cfg.validation.eval_every,
                "federated (combined from the devices that can run each variant)"
                if cfg.validation.bn_calibration == "federated"
                else "calibrated on each device's own data",
            )

        jobs = self.environment.async_jobs

        def finished_round(record: RoundRecord) -> None:
            self.versions.after(self.served_now())
            if self.live is not None:
                self.live.round_finished(record, self._validated_points() if record.val_accuracy is not None else None)
            # Messages of older rounds are stale, except the answers of asynchronous jobs still in flight.
            oldest = None if jobs is None else jobs.oldest()
            self.events.filter.advance(record.round if oldest is None else min(oldest, record.round))
            self.pump(0)

        self.stopwatch = StopWatch(self.out, self.loop.stop, self.events.ending)
        self.stopwatch.start()
        if self.loop.stop.is_set():  # a SIGTERM before the rounds began
            self.stopwatch.request("by SIGTERM")
        try:
            self.run_rounds(resume_previous, tensorboard, finished_round=finished_round)
            if jobs is not None:
                jobs.close()
        except WaitTimeout as exc:
            if self.live is not None:
                self.live.finished("failed", str(exc))
            raise ServerError(
                f"{exc} (federation {cfg.federation!r}); stopping: {self.saved()}. Start more agents or lower --min-clients, "
                "then run the same command again to resume (--wait-timeout 0 waits forever)"
            ) from None
        finally:
            self.stopwatch.close()
            self.stopwatch = None
        self.devices.finished = self.loop.finished or self.loop.ended is not None
        return self.history

    def request_stop(self) -> None:
        """End the run after the round in progress (SIGTERM; ``feast-server stop`` writes a request file instead)."""
        if self.stopwatch is not None:
            self.stopwatch.request("by SIGTERM")
        else:
            self.loop.stop.set()
            self.events.ending.set()

    # ------------------------------------------------------------------ models
    def export(self, federated_bn: bool | None = None, model_version: int | None = None) -> list[dict[str, Any]]:
        """Every registered device's model (see :meth:`RunHost.export_models`); without --data, with the online devices'
        federated BN statistics (``federated_bn``; None: when connected and ``--bn-calibration federated``) or for the
        device to calibrate on its own data. ``model_version``: the version it is (None: the run's final version)."""
        if federated_bn is None:
            federated_bn = (
                self.link.connected
                and self.config.validation.bn_calibration == "federated"
                and self.config.federated_statistics
            )
        if self.threads is not None:
            self.threads.use("exporting")
        if model_version is None:
            model_version = self.final_version()
        return self.export_models(self._federated_statistics if federated_bn else None, model_version)

    # ------------------------------------------------------------------ versions
    def served_now(self) -> Served | None:
        """What the run serves after its last round (None: no validation chose a round yet)."""
        best = self.loop.best
        if best.get("round") is None:
            return None
        return self._served(best)

    def final_version(self) -> int:
        """The version number of what the run's checkpoint serves, as its final export (server.versions)."""
        fields = read_record(self.out / CHECKPOINT).get("fields", {}) if (self.out / CHECKPOINT).is_file() else {}
        best = fields.get("best") or {}
        served = served_record(int(fields.get("round", len(self.history))), best)
        history = fields.get("history") or []
        dp = (history[-1].get("dp") if history else None) or {}
        return self.versions.final(self._served({**served, "val_accuracy": best.get("val_accuracy")}, dp))

    def _served(self, best: Mapping[str, Any], dp: Mapping[str, Any] | None = None) -> Served:
        span = best.get("average_of")
        if dp is None:
            dp = self.history[-1].dp if self.history else {}
        return Served(
            round=int(best["round"]),
            average_of=(int(span[0]), int(span[1])) if span else None,
            reason=str(best.get("reason") or ""),
            val_accuracy=best.get("val_accuracy"),
            epsilon=dp.get("epsilon"),
        )

    def _distrusted(self) -> set[str]:
        """The devices the served-round rule no longer trusts (feast_edge.evaluate.served_round)."""
        validations = [(r.round, r.validation) for r in self.history if r.validation.get("source") == "devices"]
        return set(distrusted_in(validations))

    def _federated_statistics(self, model: Supernet, devices: list[Device], rounds: int) -> dict[Arch, Calibrated]:
        """The online devices' BN statistics of every served variant (method §8 on the federation's data)."""
        served = {self.cache.entries[s.index].arch for s in self.serving(devices, self.trained()).values()}
        variants = {arch: extract(model, arch) for arch in sorted(served, key=str)}
        t = max(rounds, self.events.filter.current_round)  # after the last round: its messages are not stale
        return self.calibration.calibrate(t, model.state_dict(), variants)

    def announce_models(self, manifests: list[dict[str, Any]]) -> list[str]:
        """Push each online device its model (ModelReady + chunks), recorded as offers of the version it is; returns
        the devices served."""
        # A device offered this version already (mid-run) is not sent it again: it compared or installed it then.
        fresh = [m for m in manifests if m["device"] not in self.versions.offered_already(m)]
        sent = self.models.push(fresh, self.online_devices())
        self.versions.record_offers(fresh, sent)
        return sent

    def await_device_models(
        self, manifests: list[dict[str, Any]], devices: list[str], timeout: float
    ) -> dict[str, dict[str, Any]]:
        """Without server data: wait until each of ``devices`` reported the model of its manifest calibrated (with its
        held-out accuracy), went offline, or ``timeout``; returns what each reported. Every 30 s a line names the devices
        still awaited and how long the wait may last: one silent device costs at most ``timeout``, and says so."""
        began = time.monotonic()
        end, said = began + timeout, began
        rounds = {m["device"]: m["rounds"] for m in manifests}
        versions = {m["device"]: m.get("model_version") for m in manifests}
        reports: dict[str, dict[str, Any]] = {}
        offline: dict[str, float] = {}  # device -> since when it is offline
        gone: set[str] = set()
        while time.monotonic() < end and not self.stop.is_set():
            online, now = set(self.online_devices()), time.monotonic()
            for device in devices:
                metrics = (d.metrics if (d := self.registry.get(device)) is not None else None) or {}
                settled = (
                    "holdout_accuracy" in metrics or metrics.get("model_kept") is False
                )  # kept none: no --model-dir
                version = versions.get(device)
                answer = self.book.answers(version).get(device) if isinstance(version, int) else None
                if settled and metrics.get("model_round") == rounds.get(device):
                    reports[device] = metrics
                elif answer is not None and answer.event == REFUSED:  # it keeps the model it runs: nothing to wait for
                    reports[device] = {**metrics, "version_refused": answer.reason or answer.verdict().words()}
                elif device in online:
                    offline.pop(device, None)
                elif now - offline.setdefault(device, now) >= OFFLINE_GRACE:
                    gone.add(device)  # disconnected for good: it cannot report this model any more
            waiting = sorted(set(devices) - set(reports) - gone)
            if not waiting:
                break
            if time.monotonic() - said >= 30:
                said = time.monotonic()
                log.info(
                    "waiting for the calibrated-model reports of %s (%.0f s more at most, --round-timeout)",
                    ", ".join(waiting),
                    end - said,
                )
            self.pump(0.2)
        missing = sorted(set(devices) - set(reports))
        if missing:
            log.warning(
                "no calibrated-model report from %s after %.0f s%s",
                ", ".join(missing),
                time.monotonic() - began,
                f" ({', '.join(sorted(gone))} went offline)" if gone else "",
            )
        return reports

    def finish(self, manifests: list[dict[str, Any]]) -> None:
        """Tell every registered device that the federation is over."""
        self.devices.finished = True
        devices = [(d.device_id, d.instance) for d in self.registry.devices()]
        self.models.finish(
            devices, self.config.training.horizon or 0, len(self.history), [m["device"] for m in manifests]
        )

    def serve(self, seconds: float | None = None) -> None:
        """Answer model requests (and registrations) until ``stop`` is set or ``seconds`` pass."""
        end = None if seconds is None else time.monotonic() + seconds
        while not self.stop.is_set() and (end is None or time.monotonic() < end):
            self.pump(0.2)
