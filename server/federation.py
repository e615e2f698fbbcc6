"""The federation server: registry, cohorts, routing, collection, aggregation, checkpoints, export (docs/protocol.md §7).

Round ``t`` computes exactly what ``feast_edge.simulate.Simulation.run_round(t)``
computes, through the same functions (``feast_edge.federation``); only the
transport differs. Everything that arrives from the broker is parsed in paho's
network thread and queued; one thread (the caller of :meth:`run`) handles the
queue, so the round state never races.

    cohort = sample_round_cohort(online registered ids, m, seed, t)
    per device: plan_client -> route_state -> payload.encode -> chunks down + RoundStart
    collect until every cohort device replied or went offline, or the deadline:
        decode(upload, preset, expected=routed manifest) -- tensors must match the routed envelope
    >= K valid updates: aggregate_updates (sorted by device id); else the model stays unchanged
    checkpoint (atomic): weights + round + registry snapshot + history
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feast_edge.cache import load_cache
from feast_edge.checkpoint import load_supernet, read_record, save_supernet
from feast_edge.errors import FeastError
from feast_edge.evaluate import evaluate_variants
from feast_edge.federation import aggregate_updates, client_seed, plan_client, sample_round_cohort
from feast_edge.payload import Manifest, PayloadError, decode, encode
from feast_edge.preset import load_preset
from feast_edge.route import route_state
from feast_edge.supernet import Supernet
from feast_edge.train import TrainConfig, cosine_lr
from feast_edge.transport.chunks import DEFAULT_CHUNK_SIZE, Progress, Reassembler, Status, TransferInfo, describe
from feast_edge.transport.errors import LinkError, ProtocolError, TopicError
from feast_edge.transport.link import Link, LinkConfig, Received
from feast_edge.transport.messages import (
    Message,
    MessageFilter,
    Metrics,
    ModelReady,
    ModelRequest,
    Presence,
    Register,
    Registered,
    RoundStart,
    Update,
    parse,
)
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender
from feast_edge.server.data import ServerData, load_server_data
from feast_edge.server.export import export_device_models, read_device_model
from feast_edge.server.registry import Registry

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.safetensors"
BEST = "best.safetensors"
REGISTRY = "devices.sqlite"
KIND = "federation"
SERVER_ID = "server"


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
    lr: float = 0.025
    batch_size: int = 64
    method: str = "full"
    augment: bool = True
    eval_every: int = 5
    data: str | None = None
    val_samples: int = 5000
    calib_samples: int = 500
    probe_variants: int = 3
    cache: str | None = None
    federation: str = "feast"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    wait_timeout: float | None = None  # seconds to wait for enough devices (None: forever)
    send_timeout: float = 120.0

    def __post_init__(self) -> None:
        checks = [
            (self.rounds >= 1, f"--rounds {self.rounds} must be at least 1"),
            (self.min_clients >= 1, f"--min-clients {self.min_clients} must be at least 1"),
            (self.per_round >= self.min_clients, f"--per-round {self.per_round} must be at least --min-clients {self.min_clients} (a round needs that many valid updates)"),
            (self.start_clients is None or self.start_clients >= self.min_clients, f"--start-clients {self.start_clients} must be at least --min-clients {self.min_clients}"),
            (self.round_timeout > 0, f"--round-timeout {self.round_timeout} must be > 0 seconds"),
            (self.eval_every >= 1, f"--eval-every {self.eval_every} must be at least 1"),
            (self.wait_timeout is None or self.wait_timeout > 0, f"--wait-timeout {self.wait_timeout} must be > 0 seconds"),
        ]
        for ok, message in checks:
            if not ok:
                raise ServerError(message)

    def train_config(self) -> TrainConfig:
        """The local-training settings every device receives (as ``SimulationConfig.train_config``)."""
        return TrainConfig(lr=self.lr, batch_size=self.batch_size, variants=self.method, augment=self.augment)

    def decisive(self) -> dict[str, Any]:
        """The settings that change the trained weights (a resumed run must keep them)."""
        names = ("preset", "rounds", "per_round", "min_clients", "seed", "lr", "batch_size", "method", "augment", "cache", "federation")
        return {name: getattr(self, name) for name in names}


@dataclass
class RoundRecord:
    """What one round did; stored in every checkpoint and shown in the progress display."""

    round: int
    lr: float
    cohort: list[str]
    updated: list[str] = field(default_factory=list)  # devices whose valid update entered the aggregate
    rejected: dict[str, str] = field(default_factory=dict)  # device -> why its update was refused
    missing: list[str] = field(default_factory=list)  # no reply by the deadline
    dropped: list[str] = field(default_factory=list)  # went offline during the round
    ignored: list[str] = field(default_factory=list)  # duplicate, stale or foreign messages, with the reason
    applied: bool = False
    loss: float | None = None
    samples: int = 0
    compute_seconds: dict[str, float] = field(default_factory=dict)  # local training time each device reported
    send_seconds: float = 0.0  # routing, encoding and publishing every routed payload
    aggregate_seconds: float = 0.0
    seconds: float = 0.0  # the whole round, from cohort sampling to the aggregated model
    val_accuracy: float | None = None


@dataclass
class _Pending:
    """The server's side of one cohort device in the current round."""

    manifest: Manifest
    routed: str  # transfer id of the routed payload
    update: Update | None = None
    state: dict[str, torch.Tensor] | None = None
    error: str | None = None


class FederationServer:
    """Runs a federation over one MQTT link; see the module docstring."""

    def __init__(
        self,
        config: ServerConfig,
        link_config: LinkConfig,
        *,
        on_round: Callable[[RoundRecord, int], None] | None = None,
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.out = Path(config.out)
        self.preset = load_preset(config.preset)
        self.cache = load_cache(self.preset, config.cache)
        self.classes = self.preset.classes
        self.train_config = config.train_config()
        self.topics = Topics(config.federation)
        self.data: ServerData | None = None
        if config.data is not None:
            self.data = load_server_data(config.data, self.preset, config.val_samples, config.calib_samples)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model = Supernet(self.preset, seed=config.seed)
        self.history: list[RoundRecord] = []
        self.best: dict[str, Any] = {}
        n = len(self.cache)
        picks = np.linspace(0, n - 1, min(config.probe_variants, n)).round().astype(int)
        self.probes = [self.cache.entries[i].arch for i in sorted(set(picks.tolist()))]
        self.registry = Registry(self.out / REGISTRY)
        self.registry.mark_all_offline()
        presence = Presence(federation=config.federation, round=0, device=SERVER_ID, state="online", role="server")
        self.link = Link(link_config, presence=presence)
        self.on_round = on_round
        self.on_status = on_status
        self.stop = threading.Event()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=100_000)
        self._filter = MessageFilter(config.federation)
        self._hosts_online: set[str] = set()
        # Devices whose host went offline since they registered: a new agent instance may take over their id.
        self._released: set[str] = set()
        self._round: int | None = None
        self._pending: dict[str, _Pending] = {}
        self._record: RoundRecord | None = None
        self._unclaimed: OrderedDict[str, Progress] = OrderedDict()  # completed uploads whose announcement has not arrived
        self._last_poll = 0.0
        self.sender: ChunkSender | None = None
        self.receiver: ChunkReceiver | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> None:
        """Connect to the broker and subscribe; raises a LinkError that says how to fix the connection."""
        self.link.connect(timeout=timeout)
        t = self.topics
        # Presence first: retained statuses then arrive before any registration that follows.
        self.link.subscribe(t.status("+"), self._on_message("status"))
        self.link.subscribe(t.register, self._on_message("register"))
        self.link.subscribe(t.events, self._on_message("events"))
        self.sender = ChunkSender(self.link, t, "down", chunk_size=self.config.chunk_size)
        reassembler = Reassembler(federation=self.config.federation, max_chunk_size=self.config.chunk_size)
        self.receiver = ChunkReceiver(self.link, t, "up", reassembler=reassembler)
        self._status(f"connected to {self.link.address} as federation {self.config.federation!r}; preset {self.preset.name}, {len(self.cache)} cached variants")

    def close(self) -> None:
        """Publish the offline status and disconnect."""
        self.link.close()
        self.registry.close()

    def _status(self, text: str) -> None:
        log.info(text)
        if self.on_status is not None:
            self.on_status(text)

    # ------------------------------------------------------------------ incoming (paho's thread)
    def _on_message(self, channel: str) -> Callable[[Received], None]:
        def handle(received: Received) -> None:
            if channel == "status" and not received.payload:
                return  # a cleared retained status
            try:
                topic = self.topics.parse(received.topic)
                message = parse(received.payload)
            except (ProtocolError, TopicError) as exc:
                log.warning("dropped malformed message on %s: %s", received.topic, exc)
                return
            if topic.device is not None and message.device != topic.device:
                log.warning("dropped %s message on %s: it names device %r", message.kind, received.topic, message.device)
                return
            try:
                self._inbox.put_nowait((channel, message))
            except queue.Full:
                log.warning("server inbox full; dropped a %s message from %s", message.kind, message.device)

        return handle

    # ------------------------------------------------------------------ event loop (the run thread)
    def pump(self, seconds: float) -> None:
        """Handle incoming messages and finished transfers for ``seconds`` (0: only what is queued now)."""
        end = time.monotonic() + seconds
        while True:
            self._drain_transfers()
            now = time.monotonic()
            if self.receiver is not None and now - self._last_poll >= 0.5:
                self.receiver.poll()
                self._last_poll = now
            try:
                channel, message = self._inbox.get_nowait()
            except queue.Empty:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return
                try:
                    channel, message = self._inbox.get(timeout=min(remaining, 0.05))
                except queue.Empty:
                    continue
            try:
                self._handle(channel, message)
            except FeastError as exc:  # a bad message must never stop the server
                log.warning("could not handle %s from %s: %s", message.kind, message.device, exc)
            except Exception:  # nor a bug in handling one: log it with its traceback and go on
                log.exception("failed to handle %s from %s", message.kind, message.device)

    def _ignore(self, message: Message, reason: str) -> None:
        log.info("ignored %s from %s: %s", message.kind, message.device, reason)
        if self._record is not None:
            self._record.ignored.append(f"{message.kind} from {message.device}: {reason}")

    def _handle(self, channel: str, message: Message) -> None:
        verdict = self._filter.verdict(message)
        if verdict is not None:
            self._ignore(message, verdict)
            return
        if channel == "status" and isinstance(message, Presence):
            self._on_presence(message)
        elif channel == "register" and isinstance(message, Register):
            self._on_register(message)
        elif channel == "events" and isinstance(message, Update):
            self._on_update(message)
        elif channel == "events" and isinstance(message, Metrics):
            if self.registry.get(message.device) is not None:
                self.registry.touch(message.device, metrics=message.values)
                log.info("metrics from %s: %s", message.device, json.dumps(message.values, sort_keys=True)[:300])
        elif channel == "events" and isinstance(message, ModelRequest):
            self._serve_model(message.device, request=message.msg_id)
        else:
            self._ignore(message, f"a {message.kind} message does not belong on the {channel} topic")

    def _on_presence(self, message: Presence) -> None:
        if message.role != "device":
            return
        host = message.device
        if message.state == "online":
            if host not in self._hosts_online:
                self._hosts_online.add(host)
                devices = self.registry.set_host_status(host, "online")
                if devices:
                    log.info("host %s is online (%s)", host, ", ".join(devices))
            return
        self._hosts_online.discard(host)
        devices = self.registry.set_host_status(host, "offline")
        self._released.update(devices)
        for device in devices:
            pending = self._pending.get(device)
            if pending is not None and pending.state is None and pending.error is None and self._record is not None:
                if device not in self._record.dropped:
                    self._record.dropped.append(device)
                log.warning("device %s went offline during round %s; not waiting for its update", device, self._round)
        if devices:
            log.info("host %s is offline (%s)", host, ", ".join(devices))

    def _on_register(self, message: Register) -> None:
        device = message.device
        reason = ""
        if message.preset_digest != self.preset.digest:
            reason = (
                f"preset mismatch: the device trains preset {message.preset!r}, this federation trains {self.preset.name!r}; "
                f"start feast-agent with --preset {self.preset.name} (or a profile measured for it)"
            )
        elif message.samples < 1:
            reason = "the device has no training examples; check --data"
        elif not self.cache.affordable(message.budget_macs):
            smallest = self.cache.smallest.macs
            reason = (
                f"budget {message.budget_macs / 1e6:.2f}M MACs is below the smallest cached variant ({smallest / 1e6:.2f}M MACs) "
                f"of preset {self.preset.name}; raise --budget or use a profile of a stronger device"
            )
        else:
            existing = self.registry.get(device)
            taken = existing is not None and existing.instance != message.instance and existing.host in self._hosts_online
            if taken and device not in self._released:
                reason = (
                    f"device id {device!r} is already online (hosted by agent {existing.host!r}); give this agent another "
                    "--device-id, or stop the other agent first"
                )
        accepted = not reason
        if accepted:
            self._released.discard(device)
            status = "online" if message.host in self._hosts_online else "offline"
            self.registry.register(
                device,
                host=message.host,
                instance=message.instance,
                budget_macs=message.budget_macs,
                samples=message.samples,
                preset=message.preset,
                profile=message.profile,
                status=status,
            )
            log.info("registered %s (host %s): budget %.2fM MACs, %d samples", device, message.host, message.budget_macs / 1e6, message.samples)
        else:
            log.warning("refused the registration of %s: %s", device, reason)
        reply = Registered(
            federation=self.config.federation, round=0, device=device, instance=message.instance, accepted=accepted, reason=reason,
            preset=self.preset.name, rounds=self.config.rounds,
        )
        self.link.publish(self.topics.ctrl(device), reply.encode())

    def online_devices(self) -> list[str]:
        """Registered devices whose host is online, sorted."""
        return sorted(d.device_id for d in self.registry.devices() if d.host in self._hosts_online)

    # ------------------------------------------------------------------ uploads
    def _on_update(self, message: Update) -> None:
        device, t = message.device, self._round
        if t is None or message.round != t:
            self._ignore(message, f"round {message.round} is not the current round {t}")
            return
        pending = self._pending.get(device)
        if pending is None:
            self._ignore(message, f"{device} is not in round {t}'s cohort")
            return
        if message.routed != pending.routed:
            self._ignore(message, f"it answers routed transfer {message.routed}, not this round's {pending.routed} (sent before a server restart?)")
            return
        if pending.update is not None:
            self._ignore(message, f"duplicate update for round {t} (the first one counts)")
            return
        try:
            info = TransferInfo.from_dict(message.transfer)
        except ProtocolError as exc:
            self._reject(device, f"invalid transfer description: {exc}")
            return
        if info.device != device or info.round != t:
            self._reject(device, f"its transfer names device {info.device!r} round {info.round}, not {device!r} round {t}")
            return
        pending.update = message
        assert self.receiver is not None
        finished = self._unclaimed.pop(info.transfer, None)
        if finished is not None:
            self._accept_transfer(device, pending, finished)
        else:
            self.receiver.expect(info)

    def _drain_transfers(self) -> None:
        if self.receiver is None:
            return
        while True:
            try:
                progress = self.receiver.results.get_nowait()
            except queue.Empty:
                return
            info = progress.info
            pending = self._pending.get(info.device)
            if self._round is None or info.round != self._round or pending is None:
                log.info("dropped upload %s from %s: not expected in round %s", info.transfer, info.device, self._round)
                continue
            if pending.update is None:
                self._unclaimed[info.transfer] = progress  # the update message may still be on its way
                while len(self._unclaimed) > 64:
                    self._unclaimed.popitem(last=False)
                continue
            if pending.update.transfer.get("transfer") != info.transfer:
                log.info("dropped upload %s from %s: its update announced transfer %s", info.transfer, info.device, pending.update.transfer.get("transfer"))
                continue
            self._accept_transfer(info.device, pending, progress)

    def _accept_transfer(self, device: str, pending: _Pending, progress: Progress) -> None:
        if pending.state is not None or pending.error is not None:
            return
        if progress.status is not Status.COMPLETE or progress.payload is None:
            self._reject(device, progress.reason or f"transfer {progress.status.value}")
            return
        try:
            manifest, state = decode(progress.payload, self.preset, expected=pending.manifest)
        except PayloadError as exc:
            self._reject(device, str(exc))
            return
        if manifest.kind != "update":
            self._reject(device, f"payload kind {manifest.kind!r} is not 'update'")
            return
        pending.state = state
        log.info("round %d: valid update from %s (%d samples)", self._round, device, pending.update.samples if pending.update else 0)

    def _reject(self, device: str, reason: str) -> None:
        pending = self._pending.get(device)
        if pending is not None and pending.error is None and pending.state is None:
            pending.error = reason
        if self._record is not None:
            self._record.rejected[device] = reason
        log.warning("round %s: rejected the update of %s: %s; the global model is untouched by it", self._round, device, reason)

    # ------------------------------------------------------------------ rounds
    def wait_for_devices(self, needed: int) -> list[str]:
        """Block until ``needed`` registered devices are online (``wait_timeout`` bounds it)."""
        start = time.monotonic()
        last_note = -1
        while not self.stop.is_set():
            online = self.online_devices()
            if len(online) >= needed:
                return online
            if len(online) != last_note:
                self._status(f"waiting for devices: {len(online)} of {needed} online ({', '.join(online) or 'none yet'})")
                last_note = len(online)
            if self.config.wait_timeout is not None and time.monotonic() - start > self.config.wait_timeout:
                raise ServerError(
                    f"only {len(online)} of the {needed} devices needed were online after {self.config.wait_timeout:g} s "
                    f"(federation {self.config.federation!r}); start more agents or lower --min-clients"
                )
            self.pump(0.2)
        raise KeyboardInterrupt

    def run_round(self, t: int, needed: int) -> RoundRecord:
        """One round: cohort -> routed payloads -> collection -> sparse aggregation (or unchanged)."""
        cfg = self.config
        assert self.sender is not None and self.receiver is not None
        self._filter.advance(t)
        self.receiver.reassembler.advance(t)
        online = self.wait_for_devices(needed)
        start = time.monotonic()
        self._round = t
        cohort = sample_round_cohort(online, min(cfg.per_round, len(online)), cfg.seed, t)
        lr = cosine_lr(cfg.lr, t, cfg.rounds)
        record = self._record = RoundRecord(round=t, lr=lr, cohort=cohort)
        self._pending = {}
        self._unclaimed.clear()
        global_state = self.model.state_dict()
        deadline = start + cfg.round_timeout
        train = asdict(self.train_config)
        train["randaugment"] = list(train["randaugment"])
        for device_id in cohort:
            device = self.registry.get(device_id)
            assert device is not None
            plan = plan_client(self.cache, device.budget_macs)
            layout = plan.layout(self.preset, self.classes)
            manifest = Manifest(self.preset.name, self.preset.digest, self.classes, plan.envelope, round=t, kind="routed", fields={"device": device_id})
            blob = encode(route_state(global_state, layout, self.preset), manifest)
            info = describe(blob, federation=cfg.federation, round=t, device=device_id, chunk_size=cfg.chunk_size)
            self._pending[device_id] = _Pending(manifest, info.transfer)
            remaining = max(1.0, deadline - time.monotonic())
            start_message = RoundStart(
                federation=cfg.federation,
                round=t,
                device=device_id,
                transfer=info.to_dict(),
                deadline=time.time() + remaining,
                timeout=remaining,
                rounds=cfg.rounds,
                lr=lr,
                seed=str(client_seed(cfg.seed, t, device_id)),
                plan={"affordable": [a.to_dict() for a in plan.affordable], "global_min": plan.global_min.to_dict()},
                train=train,
            )
            try:
                # Announce first, so the device expects (and nacks) the transfer even if its first chunks are lost.
                self.link.publish(self.topics.ctrl(device_id), start_message.encode())
                self.sender.send(blob, round=t, device=device_id, transfer=info.transfer, timeout=cfg.send_timeout)
            except LinkError as exc:
                self._reject(device_id, f"could not send its routed payload: {exc}")
            self.pump(0)
        record.send_seconds = time.monotonic() - start
        log.info("round %d: routed payloads sent to %s", t, ", ".join(cohort))
        while time.monotonic() < deadline and not self.stop.is_set():
            if all(p.state is not None or p.error is not None or d in record.dropped for d, p in self._pending.items()):
                break
            self.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        if self.stop.is_set():
            raise KeyboardInterrupt
        self._drain_transfers()
        valid = [(d, p.state, p.update.samples) for d, p in sorted(self._pending.items()) if p.state is not None and p.update is not None]
        record.updated = [d for d, _, _ in valid]
        record.missing = [d for d, p in self._pending.items() if p.update is None and p.error is None and d not in record.dropped]
        samples_seen = 0
        loss = 0.0
        for d, p in self._pending.items():
            if p.state is None or p.update is None:
                continue
            metrics = p.update.metrics
            seen = _number(metrics.get("samples_seen"), p.update.samples)
            if "loss" in metrics:
                loss += _number(metrics["loss"], 0.0) * seen
                samples_seen += seen
            if "compute_seconds" in metrics:
                record.compute_seconds[d] = _number(metrics["compute_seconds"], 0.0)
            self.registry.touch(d, participated=len(valid) >= cfg.min_clients)
        record.loss = loss / samples_seen if samples_seen else None
        record.samples = sum(n for _, _, n in valid)
        if len(valid) >= cfg.min_clients:
            began = time.monotonic()
            aggregate_updates(global_state, valid, inplace=True)  # global_state aliases the model's tensors
            record.aggregate_seconds = time.monotonic() - began
            record.applied = True
        else:
            log.warning(
                "round %d: %d valid update(s) from a cohort of %d, fewer than --min-clients %d; the global model stays unchanged",
                t, len(valid), len(cohort), cfg.min_clients,
            )
        record.seconds = time.monotonic() - start
        self._round = None
        self._pending = {}
        self._record = None
        return record

    # ------------------------------------------------------------------ checkpoints
    def fingerprint(self) -> str:
        data = {**self.config.decisive(), "preset_digest": self.preset.digest}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def _save(self, name: str) -> None:
        save_supernet(
            self.out / name,
            self.model,
            kind=KIND,
            fingerprint=self.fingerprint(),
            config=self.config.decisive(),
            data=self.config.data,
            seed=self.config.seed,
            round=len(self.history),
            history=[asdict(h) for h in self.history],
            best=self.best,
            registry=self.registry.snapshot(),
        )

    def resume(self) -> int:
        """Load the last completed round from ``out``, if any; returns the number of completed rounds."""
        path = self.out / CHECKPOINT
        if not path.is_file():
            return 0
        fields = read_record(path).get("fields", {})
        if fields.get("kind") != KIND:
            raise ServerError(f"{path} is not a federation checkpoint; use another --out")
        if fields.get("fingerprint") != self.fingerprint():
            theirs, ours = fields.get("config", {}), self.config.decisive()
            differ = sorted(k for k in ours if json.dumps(ours[k]) != json.dumps(theirs.get(k)))
            raise ServerError(
                f"{path} belongs to a federation with other settings (differs in: {', '.join(differ) or 'the preset'}); "
                "restart with the same options to resume it, or use another --out"
            )
        model, record = load_supernet(path, self.preset)
        self.model.load_state_dict(model.state_dict())
        self.history = [RoundRecord(**h) for h in record["fields"]["history"]]
        self.best = record["fields"].get("best", {})
        return len(self.history)

    def validate(self) -> float:
        """Mean validation accuracy of the probe variants, each BN-recalibrated (SPEC §8)."""
        assert self.data is not None
        d = self.data
        return float(np.mean(evaluate_variants(self.model, self.probes, d.calibration_images, d.validation_images, d.validation_labels)))

    # ------------------------------------------------------------------ the whole run
    def run(self) -> list[RoundRecord]:
        """Resume if possible, run the remaining rounds, checkpoint each; returns the history."""
        cfg = self.config
        done = self.resume()
        if done:
            self._status(f"resuming from {self.out / CHECKPOINT}: {done} of {cfg.rounds} rounds completed")
        if self.data is None:
            self._status("no --data: skipping validation (and the ONNX export needs calibration data)")
        first = True
        for t in range(done, cfg.rounds):
            needed = (cfg.start_clients or cfg.min_clients) if first else cfg.min_clients
            record = self.run_round(t, needed)
            first = False
            if self.data is not None and ((t + 1) % cfg.eval_every == 0 or t + 1 == cfg.rounds):
                record.val_accuracy = self.validate()
            self.history.append(record)
            if record.val_accuracy is not None and record.val_accuracy > self.best.get("val_accuracy", -1.0):
                self.best = {"round": t, "val_accuracy": record.val_accuracy}
                self._save(BEST)
            self._save(CHECKPOINT)
            if self.on_round is not None:
                self.on_round(record, cfg.rounds)
            self.pump(0)
        return self.history

    # ------------------------------------------------------------------ models
    def export(self) -> list[dict[str, Any]]:
        """Export every registered device's model (from the best checkpoint if validated, else the last)."""
        if self.data is None:
            raise ServerError("exporting needs server-held calibration data; pass --data (a partition directory or Fashion-MNIST)")
        best = self.out / BEST
        source = best if best.is_file() else self.out / CHECKPOINT
        if not source.is_file():
            raise ServerError(f"no checkpoint in {self.out}; run the federation first (feast-server run --out {self.out})")
        model = load_supernet(source, self.preset)[0]
        rounds = int(read_record(source).get("fields", {}).get("round", 0))
        devices = self.registry.devices()
        if not devices:
            raise ServerError(f"no device is registered in {self.out / REGISTRY}; nothing to export")
        return export_device_models(
            model, self.cache, devices, self.data, self.out, federation=self.config.federation, rounds_done=rounds, checkpoint=source.name, progress=self.on_status
        )

    def announce_models(self, manifests: list[dict[str, Any]]) -> list[str]:
        """Push each online device its model (ModelReady + chunks); returns the devices served."""
        online = set(self.online_devices())
        served = []
        for manifest in manifests:
            if manifest["device"] in online and self._serve_model(manifest["device"]):
                served.append(manifest["device"])
        return served

    def _serve_model(self, device: str, request: str = "") -> bool:
        """Send a device its exported model, or tell it why there is none."""
        assert self.sender is not None
        try:
            found = read_device_model(self.out, device)
        except FeastError as exc:
            found, reason = None, str(exc)
        else:
            reason = f"no model has been exported for device {device!r} yet; models are exported after the last round (or by 'feast-server export')"
        base = {"federation": self.config.federation, "round": 0, "device": device, "request": request}
        if found is None:
            self.link.publish(self.topics.ctrl(device), ModelReady(**base, available=False, reason=reason).encode())
            log.info("model request of %s: %s", device, reason)
            return False
        blob, manifest = found
        info = describe(blob, federation=self.config.federation, round=0, device=device, chunk_size=self.config.chunk_size)
        self.link.publish(self.topics.ctrl(device), ModelReady(**base, transfer=info.to_dict(), manifest=manifest).encode())
        try:
            self.sender.send(blob, round=0, device=device, transfer=info.transfer, timeout=self.config.send_timeout)
        except LinkError as exc:
            log.warning("could not send the model of %s: %s", device, exc)
            return False
        log.info("sent %s its model %s (%d bytes)", device, manifest.get("file"), len(blob))
        return True

    def serve(self, seconds: float | None = None) -> None:
        """Answer model requests (and registrations) until ``stop`` is set or ``seconds`` pass."""
        end = None if seconds is None else time.monotonic() + seconds
        while not self.stop.is_set() and (end is None or time.monotonic() < end):
            self.pump(0.2)


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) else default
