"""The federation server: one MQTT link, the run loop, and the pieces that each do one job (docs/protocol.md §7).

* ``devices.DeviceBook``: registrations and presence (who may be in a cohort);
* ``collect.MqttCollector``: one round's routed payloads down and updates up;
* ``feast_edge.run.loop.RunLoop``: cohorts, aggregation, checkpoints, resume,
  validation; the loop ``feast-edge simulate`` runs, so round ``t`` here computes
  exactly what the simulation computes;
* ``export`` / ``serving.ModelServer``: per-device ONNX models, pushed or fetched.

Everything that arrives from the broker is parsed in paho's network thread and
queued; one thread (the caller of :meth:`FederationServer.run`) handles the
queue, so no state is touched from two threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast_edge.cache.variants import load_cache
from feast_edge.dashboard.state import DashboardState
from feast_edge.errors import FeastError
from feast_edge.evaluate.evaluation import Validation
from feast_edge.local.recipe import TrainConfig, TrainError, preset_recipe
from feast_edge.protocol import Declined, Metrics, ModelRequest, Register, Update
from feast_edge.run.checkpoint import load_supernet, read_record
from feast_edge.run.loop import CHECKPOINT, RoundRecord, RunError, RunLoop, RunSettings, check_run_options, recorded_settings
from feast_edge.run.roundlog import RoundLog
from feast_edge.server.collect import MqttCollector, WaitTimeout
from feast_edge.server.devices import DeviceBook
from feast_edge.server.export import export_device_models
from feast_edge.server.held_data import ServerData, load_server_data
from feast_edge.server.inbox import Inbox
from feast_edge.server.live import LiveView
from feast_edge.server.registry import Registry
from feast_edge.server.serving import ModelServer
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.chunks import Reassembler
from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE, MIN_CHUNK_SIZE
from feast_edge.transport.link import Link, Received
from feast_edge.transport.messages import Message, MessageFilter, Presence, parse
from feast_edge.transport.throttle import Throttle, channel_of
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender

log = logging.getLogger(__name__)

REGISTRY = "devices.sqlite"
KIND = "federation"
SERVER_ID = "server"

__all__ = ["CHECKPOINT", "REGISTRY", "FederationServer", "RoundRecord", "ServerConfig", "ServerError"]


class ServerError(FeastError):
    """The server cannot start, resume or continue with the given settings."""


@dataclass(frozen=True)
class ServerConfig:
    """Everything that decides the federation's result, plus where it lives (``out``) and how it waits."""

    out: str
    preset: str = "fmnist-small"
    rounds: int = 10
    per_round: int = 5
    min_clients: int = 2
    start_clients: int | None = None  # devices to wait for before the first round of this process (default: min_clients)
    round_timeout: float = 300.0
    seed: int = 0
    lr: float | None = None  # None: the preset's [train] recipe (as batch_size, augment)
    batch_size: int | None = None
    method: str = "full"
    augment: str | bool | None = None
    epochs: int | None = None  # local epochs per round (None: the recipe's)
    eval_every: int = 5
    data: str | None = None
    val_samples: int = 5000
    calib_samples: int = 500
    probe_variants: int = 3
    cache: str | None = None
    federation: str = "feast"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    wait_timeout: float = 1800.0  # idle limit: seconds a round may wait for enough devices before the run ends (0: forever)
    send_timeout: float = 120.0
    max_samples: int = 1_000_000  # the most training examples a device may register (its aggregation weight)
    max_devices: int = 10_000  # the most devices the registry takes
    aggregation: str = "mean"  # mean (SPEC §6), clip, trimmed-mean or median (feast_edge.aggregate.robust)
    trim: float = 0.1  # trimmed-mean: share of the covering values dropped at each end of a position
    clip_norm: float | None = None  # clip: L2 bound of an update (None: the cohort's median update norm)
    max_update_norm: float = 1e4  # L2 bound on an update's change of its routed slice (0: none); honest fmnist-small epochs: 14-62
    payload_dtype: str = "float32"  # of routed payloads and updates on the wire (aggregation and the model stay float32)

    def __post_init__(self) -> None:
        checks = [
            (self.rounds >= 1, f"--rounds {self.rounds} must be at least 1"),
            (self.min_clients >= 1, f"--min-clients {self.min_clients} must be at least 1"),
            (self.per_round >= self.min_clients, f"--per-round {self.per_round} must be at least --min-clients {self.min_clients} (a round needs that many valid updates)"),
            (self.start_clients is None or self.start_clients >= self.min_clients, f"--start-clients {self.start_clients} must be at least --min-clients {self.min_clients}"),
            (self.round_timeout > 0, f"--round-timeout {self.round_timeout} must be > 0 seconds"),
            (self.eval_every >= 1, f"--eval-every {self.eval_every} must be at least 1"),
            (self.wait_timeout >= 0, f"--wait-timeout {self.wait_timeout} must be >= 0 seconds (0: wait forever)"),
            (self.max_samples >= 1, f"--max-samples {self.max_samples} must be at least 1"),
            (self.max_devices >= 1, f"--max-devices {self.max_devices} must be at least 1"),
            (self.max_update_norm >= 0, f"--max-update-norm {self.max_update_norm} must be >= 0 (0: no bound)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ServerError(message)
        try:
            check_run_options(self.payload_dtype, self.aggregation, self.trim, self.clip_norm)
        except RunError as exc:
            raise ServerError(str(exc)) from None

    def recipe(self) -> tuple[TrainConfig, str]:
        """The local-training settings every device receives and the lr schedule: the preset's recipe, then these options."""
        try:
            return preset_recipe(self.preset, lr=self.lr, batch_size=self.batch_size, variants=self.method, augment=self.augment, epochs=self.epochs)
        except TrainError as exc:
            raise ServerError(f"training recipe: {exc}") from None

    def train_config(self) -> TrainConfig:
        return self.recipe()[0]

    def decisive(self) -> dict[str, Any]:
        """The settings that change the trained weights (a resumed run must keep them), the resolved recipe included."""
        names = ("preset", "rounds", "per_round", "min_clients", "seed", "lr", "batch_size", "method", "augment", "cache", "federation")
        train, schedule = self.recipe()
        recorded = recorded_settings(train, schedule, self.aggregation, self.trim, self.clip_norm, self.payload_dtype)
        return {**{name: getattr(self, name) for name in names}, **recorded}

    @classmethod
    def stored(cls, out: str | Path, **overrides: Any) -> ServerConfig:
        """The configuration of the run in ``out``, from its checkpoint (for export and serving after the run)."""
        path = Path(out) / CHECKPOINT
        if not path.is_file():
            raise ServerError(f"no federation checkpoint at {path}; point --out at a directory written by feast-server run")
        fields = read_record(path).get("fields", {})
        if fields.get("kind") != KIND:
            raise ServerError(f"{path} is not a federation checkpoint; point --out at a directory written by feast-server run")
        known = {f.name for f in dataclasses.fields(cls)}
        stored = {k: v for k, v in fields.get("config", {}).items() if k in known}
        settings = {**stored, "data": fields.get("data"), **{k: v for k, v in overrides.items() if v is not None}}
        return cls(out=str(out), **settings)

    def settings(self) -> RunSettings:
        return RunSettings(
            rounds=self.rounds, per_round=self.per_round, min_clients=self.min_clients, seed=self.seed, lr=self.train_config().lr,
            eval_every=self.eval_every, probe_variants=self.probe_variants, aggregation=self.aggregation, trim=self.trim, clip_norm=self.clip_norm,
            lr_schedule=self.recipe()[1], payload_dtype=self.payload_dtype,
        )


class FederationServer:
    """Runs a federation over one MQTT link; see the module docstring."""

    def __init__(
        self, config: ServerConfig, link_config: LinkConfig, *, on_round: Callable[[RoundRecord, int], None] | None = None, dashboard: DashboardState | None = None,
    ) -> None:
        self.config = config
        self.out = Path(config.out)
        self.preset = load_preset(config.preset)
        self.cache = load_cache(self.preset, config.cache)
        self.topics = Topics(config.federation)
        self.data: ServerData | None = None
        if config.data is not None:
            self.data = load_server_data(config.data, self.preset, config.val_samples, config.calib_samples)
        self.on_round = on_round
        self.stop = threading.Event()
        self.model = Supernet(self.preset, seed=config.seed)
        self.link = Link(
            link_config, presence=Presence(federation=config.federation, round=0, device=SERVER_ID, state="online", role="server"),
            on_reconnect=self._on_reconnect,
        )
        self.out.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(self.out / REGISTRY)
        self.devices = DeviceBook(
            self.registry, self.preset, self.cache, federation=config.federation, rounds=config.rounds,
            reply=lambda device, message: self.link.publish(self.topics.ctrl(device), message.encode()),
            on_offline=lambda devices: self.collector.on_offline(devices) if self.collector is not None else None,
            authenticated=link_config.credentials is not None, max_samples=config.max_samples, max_devices=config.max_devices,
            shard_samples=None if self.data is None else self.data.shard_samples,
        )
        self.loop = RunLoop(
            self.model, self.cache, config.settings(), self.out, kind=KIND, fingerprint=self.fingerprint(), config=config.decisive(),
            validation=None if self.data is None else Validation(self.data.calibration_images, self.data.validation_images, self.data.validation_labels),
            extra_fields=lambda: {"data": config.data, "seed": config.seed, "registry": self.registry.snapshot()},
        )
        self.collector: MqttCollector | None = None
        self.models: ModelServer | None = None
        self.live = None if dashboard is None else LiveView(
            dashboard, self.preset, self.cache, self.registry, rounds=config.rounds, federation=config.federation, payload_dtype=config.payload_dtype,
        )
        self.inbox = Inbox()
        self._filter = MessageFilter(config.federation)
        self._dropped = Throttle(log)  # bad input is logged, a few lines a minute per kind and sender
        self._last_poll = 0.0

    @property
    def history(self) -> list[RoundRecord]:
        return self.loop.history

    def fingerprint(self) -> str:
        data = {**self.config.decisive(), "preset_digest": self.preset.digest}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> None:
        """Connect to the broker and subscribe; raises a LinkError that says how to fix the connection."""
        cfg, t = self.config, self.topics
        self.link.connect(timeout=timeout)
        # Presence first: retained statuses then arrive before any registration that follows.
        self.link.subscribe(t.status("+"), self._on_message("status"))
        self.link.subscribe(t.register("+"), self._on_message("register"))
        self.link.subscribe(t.events("+"), self._on_message("events"))
        sender = ChunkSender(self.link, t, "down", chunk_size=cfg.chunk_size)
        # Uploads are taken only when announced by a cohort device's update (which also bounds their size): nothing a
        # stranger sends on xfer/up allocates anything here.
        # Every cohort device may upload at once (one announced upload each): the reassembler's transfer cap grows with the cohort.
        reassembler = Reassembler(
            federation=cfg.federation, max_chunk_size=cfg.chunk_size, min_chunk_size=MIN_CHUNK_SIZE, expected_only=True, max_transfers=max(32, cfg.per_round),
        )
        receiver = ChunkReceiver(self.link, t, "up", reassembler=reassembler)
        self.collector = MqttCollector(
            self.link, t, sender, receiver, self.devices, self.registry, self.preset, cfg.train_config(), seed=cfg.seed, rounds=cfg.rounds,
            round_timeout=cfg.round_timeout, send_timeout=cfg.send_timeout, wait_timeout=cfg.wait_timeout or None, max_update_norm=cfg.max_update_norm,
            pump=self.pump, stopped=self.stop.is_set, live=self.live, payload_dtype=cfg.payload_dtype,
        )
        self.models = ModelServer(self.out, self.link, t, sender, cfg.send_timeout)
        log.info("connected to %s as federation %r; preset %s, %d cached variants", self.link.address, cfg.federation, self.preset.name, len(self.cache))

    def close(self) -> None:
        """Publish the offline status and disconnect."""
        self.link.close()
        self.registry.close()

    # ------------------------------------------------------------------ incoming (paho's thread)
    def _on_reconnect(self) -> None:
        # Queued before the statuses that the new subscription brings: what the server knew of presence may be stale
        # (an agent that died while the broker was down left no last will), so it starts over from those statuses.
        self.inbox.put("reconnected", Presence(federation=self.config.federation, round=0, device=SERVER_ID, state="online", role="server"))

    def _on_message(self, channel: str) -> Callable[[Received], None]:
        def handle(received: Received) -> None:
            if channel == "status" and not received.payload:
                return  # a cleared retained status
            try:
                topic = self.topics.parse(received.topic)
                message = parse(received.payload)
            except (ProtocolError, TopicError) as exc:
                self._dropped.warning(f"malformed {channel_of(received.topic)}", "dropped malformed message on %s: %s", received.topic, exc)
                return
            if topic.device is not None and message.device != topic.device:
                self._dropped.warning(f"names {channel_of(received.topic)}", "dropped %s message on %s: it names device %r", message.kind, received.topic, message.device)
                return
            if isinstance(message, Update) and self.collector is not None:
                self.collector.pre_expect(message)  # its chunks follow at once, in this thread
            self.inbox.put(channel, message)

        return handle

    # ------------------------------------------------------------------ event loop (the run thread)
    def pump(self, seconds: float) -> None:
        """Handle incoming messages and finished transfers for ``seconds`` (0: only what is queued now)."""
        end = time.monotonic() + seconds
        while True:
            try:
                if self.collector is not None:
                    self.collector.drain()
                    now = time.monotonic()
                    if now - self._last_poll >= 0.5:
                        self.collector.receiver.poll()
                        self._last_poll = now
                if self.models is not None:
                    self.models.tick()  # model requests that waited for their device's interval
                if self.live is not None:
                    self.live.tick(self.devices.hosts_online, None if self.collector is None else self.collector.receiver.reassembler)
            except Exception:  # finished uploads and requests are the network's input too: never let one stop the server
                log.exception("failed to handle a finished transfer or a model request")
            got = self.inbox.get(0)
            if got is None:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return
                got = self.inbox.get(min(remaining, 0.05))
                if got is None:
                    continue
            channel, message = got
            try:
                self._handle(channel, message)
            except FeastError as exc:  # a bad message must never stop the server
                self._dropped.warning(f"handle {message.device}", "could not handle %s from %s: %s", message.kind, message.device, exc)
            except Exception:  # nor a bug in handling one: log it with its traceback and go on
                log.exception("failed to handle %s from %s", message.kind, message.device)

    def _handle(self, channel: str, message: Message) -> None:
        verdict = self._filter.verdict(message)
        if verdict is not None:
            self._ignore(f"{message.kind} from {message.device}: {verdict}")
            return
        if channel == "reconnected":
            self.devices.on_reconnect()
        elif channel == "status" and isinstance(message, Presence):
            self.devices.on_presence(message)
        elif channel == "register" and isinstance(message, Register):
            self.devices.on_register(message)
        elif channel == "events" and isinstance(message, Update) and self.collector is not None:
            self.collector.on_update(message)
        elif channel == "events" and isinstance(message, Declined) and self.collector is not None:
            self.collector.on_declined(message)
        elif channel == "events" and isinstance(message, Metrics):
            if self.registry.get(message.device) is not None:
                self.registry.touch(message.device, metrics=message.values)
                if self.live is not None:
                    self.live.device_progress(message.device, message.values)
                log.debug("metrics from %s: %s", message.device, json.dumps(message.values, sort_keys=True)[:300])
        elif channel == "events" and isinstance(message, ModelRequest) and self.models is not None:
            self.models.request(message.device, message.msg_id)
        else:
            self._ignore(f"{message.kind} from {message.device}: it does not belong on the {channel} topic")

    def _ignore(self, what: str) -> None:
        if self.collector is not None:
            self.collector.ignore(what)
        else:
            self._dropped.log(logging.INFO, what.split(":")[0], "ignored %s", what)

    def online_devices(self) -> list[str]:
        """Registered devices whose host is online, sorted."""
        return self.devices.online()

    # ------------------------------------------------------------------ the whole run
    def resume(self, previous: bool = False) -> int:
        """Load the last completed round from ``out``, if any (``previous``: fall back to the previous checkpoint if it is damaged)."""
        try:
            done = self.loop.resume("restart with the same options to resume it, or use another --out", fall_back=previous)
        except RunError as exc:
            raise ServerError(str(exc)) from None
        if self.loop.recovered:
            log.warning("%s", self.loop.recovered)
        return done

    def run(self, resume_previous: bool = False, tensorboard: bool = False) -> list[RoundRecord]:
        """Resume if possible, run the remaining rounds, checkpoint each (and ``rounds.csv``, TensorBoard scalars); returns the history."""
        assert self.collector is not None, "start() first"
        cfg = self.config
        done = self.resume(previous=resume_previous)
        if done:
            log.info("resuming from %s: %d of %d rounds completed", self.out / CHECKPOINT, done, cfg.rounds)
        if self.data is None:
            log.info("no --data: skipping validation (and the ONNX export needs calibration data)")
        self._filter.advance(done)
        if self.live is not None:
            self.live.resumed(self.history)
        roundlog = RoundLog(self.out, tensorboard=tensorboard, first_round=done + 1)

        def finished_round(record: RoundRecord) -> None:
            roundlog.write(self.history)
            for device in record.updated:
                self.registry.touch(device, participated=record.applied)
            if not record.applied:
                log.warning(
                    "round %d: %d valid update(s) from a cohort of %d, fewer than --min-clients %d; the global model stays unchanged",
                    record.round, len(record.updated), len(record.cohort), cfg.min_clients,
                )
            if self.on_round is not None:
                self.on_round(record, cfg.rounds)
            if self.live is not None:
                self.live.round_finished(record, getattr(self.loop.method, "validated", None) if record.val_accuracy is not None else None)
            self._filter.advance(record.round)
            self.pump(0)

        try:
            self.loop.run(self.collector, start_clients=cfg.start_clients, on_round=finished_round)
        except WaitTimeout as exc:
            if self.live is not None:
                self.live.finished("failed", str(exc))
            done = len(self.history)
            saved = f"round {done} is checkpointed in {self.out / CHECKPOINT}" if done else "no round was completed"
            raise ServerError(
                f"{exc} (federation {cfg.federation!r}); stopping: {saved}. Start more agents or lower --min-clients, then run the same "
                f"command again to resume (--wait-timeout 0 waits forever)"
            ) from None
        finally:
            roundlog.close()
        self.devices.finished = self.loop.finished
        return self.history

    # ------------------------------------------------------------------ models
    def export(self) -> list[dict[str, Any]]:
        """Export every registered device's model (from the best checkpoint if validated, else the last)."""
        if self.data is None:
            raise ServerError("exporting needs server-held calibration data; pass --data (a partition directory or Fashion-MNIST)")
        source = self.loop.selected_checkpoint()
        if not source.is_file():
            raise ServerError(f"no checkpoint in {self.out}; run the federation first (feast-server run --out {self.out})")
        model = load_supernet(source, self.preset)[0]
        rounds = int(read_record(source).get("fields", {}).get("round", 0))
        devices = self.registry.devices()
        if not devices:
            raise ServerError(f"no device is registered in {self.out / REGISTRY}; nothing to export")
        return export_device_models(model, self.cache, devices, self.data, self.out, federation=self.config.federation, rounds_done=rounds, checkpoint=source.name)

    def announce_models(self, manifests: list[dict[str, Any]]) -> list[str]:
        """Push each online device its model (ModelReady + chunks); returns the devices served."""
        assert self.models is not None, "start() first"
        return self.models.push(manifests, self.online_devices())

    def finish(self, manifests: list[dict[str, Any]]) -> None:
        """Tell every registered device that the federation is over."""
        assert self.models is not None, "start() first"
        self.devices.finished = True
        devices = [d.device_id for d in self.registry.devices()]
        self.models.finish(devices, self.config.rounds, len(self.history), [m["device"] for m in manifests])

    def serve(self, seconds: float | None = None) -> None:
        """Answer model requests (and registrations) until ``stop`` is set or ``seconds`` pass."""
        end = None if seconds is None else time.monotonic() + seconds
        while not self.stop.is_set() and (end is None or time.monotonic() < end):
            self.pump(0.2)
