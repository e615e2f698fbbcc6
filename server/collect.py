"""Collecting a round over MQTT: route each cohort device its slice, take back valid updates (docs/protocol.md §7).

The run loop (``feast_edge.run.loop.RunLoop``) asks this collector for one
round's updates, exactly as the simulation asks its in-process one:

    per device: route_state -> payload.encode -> RoundStart announced, then the chunks
    until every device replied, was rejected or went offline, or the deadline:
        Update announced + chunks -> decode(upload, expected = the routed manifest)
    -> Collected(valid updates, rejected with reasons, missing, dropped, ignored)

Devices that never reply do not block the round past ``round_timeout``.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from feast_edge.aggregate.robust import update_norm
from feast_edge.errors import FeastError
from feast_edge.local.recipe import TrainConfig
from feast_edge.protocol import Declined, RoundStart, Update
from feast_edge.route.envelope import route_state
from feast_edge.route.payload import Manifest, decode, encode
from feast_edge.route.plans import ClientPlan
from feast_edge.run.cohort import client_seed
from feast_edge.run.collect import ClientUpdate, Collected
from feast_edge.server.devices import DeviceBook
from feast_edge.server.live import LiveView
from feast_edge.server.registry import Registry
from feast_edge.space.geometry import Layout
from feast_edge.space.preset import Preset
from feast_edge.transport.chunks import Progress, Status
from feast_edge.transport.errors import LinkError, ProtocolError
from feast_edge.transport.link import Link
from feast_edge.transport.throttle import Throttle
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender

log = logging.getLogger(__name__)

HEARTBEAT = 10.0  # seconds between "still waiting" lines
UPLOAD_SLACK = 4096  # bytes an update's header may exceed the routed one's (the manifest names the device)
ROUTED_CACHE_BYTES = 64 * 2**20  # routed slices kept for the next devices of the same envelope while a round's payloads go out


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


class WaitTimeout(Exception):
    """Not enough devices came online within ``wait_timeout``."""


@dataclass
class _Pending:
    """The server's side of one cohort device in the current round."""

    manifest: Manifest
    routed: str  # transfer id of the routed payload
    max_bytes: int  # an upload encodes the same tensors as the routed payload: it cannot be larger
    update: Update | None = None
    state: dict[str, torch.Tensor] | None = None
    error: str | None = None

    @property
    def settled(self) -> bool:
        return self.state is not None or self.error is not None


@dataclass
class _Round:
    t: int
    global_state: Mapping[str, torch.Tensor]  # what was routed from; unchanged until the round's aggregation
    pending: dict[str, _Pending] = field(default_factory=dict)
    collected: Collected = field(default_factory=lambda: Collected([]))


class MqttCollector:
    """The deployment's collector: cohorts among online devices, payloads and updates over one link."""

    def __init__(
        self,
        link: Link,
        topics: Topics,
        sender: ChunkSender,
        receiver: ChunkReceiver,
        devices: DeviceBook,
        registry: Registry,
        preset: Preset,
        train: TrainConfig,
        *,
        seed: int,
        rounds: int,
        round_timeout: float,
        send_timeout: float,
        wait_timeout: float | None,
        max_update_norm: float,
        pump: Callable[[float], None],
        stopped: Callable[[], bool],
        live: LiveView | None = None,
        payload_dtype: str = "float32",
    ) -> None:
        self.link, self.topics, self.sender, self.receiver = link, topics, sender, receiver
        self.devices, self.registry, self.preset, self.train = devices, registry, preset, train
        self.seed, self.rounds = seed, rounds
        self.round_timeout, self.send_timeout, self.wait_timeout = round_timeout, send_timeout, wait_timeout
        self.max_update_norm = max_update_norm  # 0: no bound
        self.pump, self.stopped = pump, stopped
        self.live = live  # the dashboard's view of the round in flight (feast-server run --dashboard)
        self.payload_dtype = payload_dtype  # routed payloads go out in it; updates must come back in it
        self.current: _Round | None = None
        # device -> (round, routed transfer, upload size bound) of the round in flight; read by paho's thread (pre_expect)
        self.announced: dict[str, tuple[int, str, int]] = {}
        self._unclaimed: OrderedDict[str, Progress] = OrderedDict()  # completed uploads whose announcement has not arrived
        self._dropped = Throttle(log)

    # ------------------------------------------------------------------ Collector
    def clients(self, needed: int) -> list[str]:
        """Block until ``needed`` registered devices are online, saying who is missing at least every 10 s."""
        start = time.monotonic()
        last_note, last_online = float("-inf"), None
        while not self.stopped():
            online = self.devices.online()
            if len(online) >= needed:
                return online
            now = time.monotonic()
            if online != last_online or now - last_note >= HEARTBEAT:
                offline = self.devices.offline()
                log.info(
                    "waiting for devices: %d of %d online (%s)%s; %.0f s", len(online), needed, ", ".join(online) or "none yet",
                    f"; registered but offline: {', '.join(offline)}" if offline else "", now - start,
                )
                last_note, last_online = now, online
            if self.wait_timeout is not None and now - start > self.wait_timeout:
                raise WaitTimeout(f"only {len(online)} of the {needed} devices needed were online after {self.wait_timeout:g} s")
            self.pump(0.2)
        raise KeyboardInterrupt

    def budget(self, client: str) -> float:
        device = self.registry.get(client)
        assert device is not None, f"{client} was sampled but is not registered"
        return float(device.budget_macs)

    def collect(self, t: int, cohort: Sequence[str], plans: Mapping[str, ClientPlan], global_state: Mapping[str, torch.Tensor], lr: float) -> Collected:
        self.receiver.reassembler.advance(t)
        current = self.current = _Round(t, global_state)
        self._unclaimed.clear()
        start = time.monotonic()
        deadline = start + self.round_timeout
        classes = self.preset.classes
        if self.live is not None:
            self.live.round_started(t, cohort, self.round_timeout)
        # Devices of one budget share an envelope: its slice of the (unchanging) global state is cut once per round,
        # keeping the recent slices up to ROUTED_CACHE_BYTES (at least the last one).
        routed_by_layout: OrderedDict[Layout, dict[str, torch.Tensor]] = OrderedDict()
        for device in cohort:
            plan = plans[device]
            manifest = plan.manifest(self.preset, classes, t, "routed", device, self.payload_dtype)
            layout = plan.layout(self.preset, classes)
            routed = routed_by_layout.get(layout)
            if routed is None:
                routed = routed_by_layout[layout] = route_state(global_state, layout, self.preset)
                while len(routed_by_layout) > 1 and sum(_nbytes(r) for r in routed_by_layout.values()) > ROUTED_CACHE_BYTES:
                    routed_by_layout.popitem(last=False)
            blob = encode(routed, manifest)
            info = self.sender.describe(blob, round=t, device=device)
            current.pending[device] = _Pending(manifest, info.transfer, len(blob) + UPLOAD_SLACK)
            self.announced[device] = (t, info.transfer, len(blob) + UPLOAD_SLACK)
            remaining = max(1.0, deadline - time.monotonic())
            message = RoundStart.from_plan(
                plan, federation=self.topics.federation, round=t, device=device, transfer=info, sent_at=time.time(), timeout=remaining,
                rounds=self.rounds, lr=lr, seed=client_seed(self.seed, t, device), train=self.train, payload_dtype=self.payload_dtype,
            )
            try:
                self.sender.announce_and_send(self.topics.ctrl(device), message.encode(), blob, info, timeout=self.send_timeout)
            except LinkError as exc:
                self.reject(device, f"could not send its routed payload: {exc}")
            else:
                if self.live is not None:
                    self.live.routed(device, len(blob), info.count, plan.envelope.params(self.preset, classes))
            self.pump(0)
        routed_by_layout.clear()
        current.collected.send_seconds = time.monotonic() - start
        log.debug("round %d: routed payloads sent to %s", t + 1, ", ".join(cohort))
        got = current.collected
        last_note = time.monotonic()
        while time.monotonic() < deadline and not self.stopped():
            waiting = [d for d, p in current.pending.items() if not p.settled and d not in got.dropped]
            if not waiting:
                break
            now = time.monotonic()
            if now - last_note >= HEARTBEAT:
                log.info(
                    "round %d/%d: %d of %d updates in; waiting for %s (%.0f s left)", t + 1, self.rounds, len(cohort) - len(waiting), len(cohort),
                    ", ".join(waiting), deadline - now,
                )
                last_note = now
            self.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        if self.stopped():
            raise KeyboardInterrupt
        self.drain()
        for device, p in sorted(current.pending.items()):
            if p.state is not None and p.update is not None:
                u = p.update
                got.updates.append(ClientUpdate(device, p.state, u.samples, loss=u.loss, samples_seen=u.samples_seen, train_macs=u.train_macs, compute_seconds=u.compute_seconds))
        got.missing = [d for d, p in current.pending.items() if p.update is None and p.error is None and d not in got.dropped]
        self.current = None
        self.announced = {}
        return got

    # ------------------------------------------------------------------ events (called by the server's pump)
    def ignore(self, what: str) -> None:
        self._dropped.log(logging.INFO, what.split(":")[0], "ignored %s", what)
        if self.current is not None:
            self.current.collected.ignored.append(what)

    def on_offline(self, devices: list[str]) -> None:
        """Devices whose host went offline: a round in flight stops waiting for them."""
        current = self.current
        if current is None:
            return
        for device in devices:
            pending = current.pending.get(device)
            if pending is not None and not pending.settled and device not in current.collected.dropped:
                current.collected.dropped.append(device)
                log.warning("round %d: %s went offline; not waiting for its update", current.t + 1, device)

    def pre_expect(self, message: Update) -> None:
        """Paho's thread: take the chunks of an upload a cohort device just announced from the first one on.

        The reassembler takes only announced transfers (a stranger's frames cost nothing), and the chunks
        follow the announcement at once; :meth:`on_update` checks the rest in the run thread.
        """
        slot = self.announced.get(message.device)
        if slot is None or slot[:2] != (message.round, message.routed):
            return
        try:
            info = message.transfer_info()
        except ProtocolError:
            return
        if info.size <= slot[2]:
            self.receiver.expect(info)

    def on_declined(self, message: Declined) -> None:
        """A cohort device says no update will come (training diverged or failed): stop waiting for it."""
        current = self.current
        pending = None if current is None or message.round != current.t else current.pending.get(message.device)
        if pending is None or message.routed != pending.routed or pending.settled or pending.update is not None:
            self.ignore(f"declined from {message.device}: it does not answer an open request of the round in flight")
            return
        self.reject(message.device, f"the device sent no update: {message.reason}")

    def on_update(self, message: Update) -> None:
        device, current = message.device, self.current
        if current is None or message.round != current.t:
            self.ignore(f"update from {device}: round {message.round + 1} is not the round in flight")
            return
        pending = current.pending.get(device)
        if pending is None:
            self.ignore(f"update from {device}: not in round {current.t + 1}'s cohort")
            return
        if message.routed != pending.routed:
            self.ignore(f"update from {device}: it answers routed transfer {message.routed}, not this round's {pending.routed} (sent before a server restart?)")
            return
        if pending.update is not None:
            self.ignore(f"update from {device}: duplicate for round {current.t + 1} (the first one counts)")
            return
        try:
            info = message.transfer_info()
        except ProtocolError as exc:
            self.reject(device, f"invalid transfer description: {exc}")
            return
        registered = self.registry.get(device)
        limit = registered.samples if registered is not None else 0
        problem = ""
        if not 1 <= message.samples <= limit:
            # The sample count is the aggregation weight: more than the device registered would let it outweigh everyone.
            problem = f"it claims {message.samples} samples; the aggregation weight must be between 1 and the {limit} it registered"
        elif info.size > pending.max_bytes:
            problem = f"its upload declares {info.size} bytes; the slice routed to it encodes to at most {pending.max_bytes}"
        if problem:
            self.receiver.reassembler.discard(info.transfer, problem)
            self.reject(device, problem)
            return
        pending.update = message
        finished = self._unclaimed.pop(info.transfer, None)
        if finished is not None:
            self._accept(device, pending, finished)
        else:
            self.receiver.expect(info)

    def drain(self) -> None:
        """Match finished upload transfers with their announcements."""
        while True:
            try:
                progress = self.receiver.results.get_nowait()
            except queue.Empty:
                return
            info, current = progress.info, self.current
            pending = current.pending.get(info.device) if current is not None else None
            if current is None or info.round != current.t or pending is None:
                self._dropped.log(logging.INFO, f"upload {info.device}", "dropped upload %s from %s: not expected in the round in flight", info.transfer, info.device)
                continue
            if pending.update is None:
                self._unclaimed[info.transfer] = progress  # the update message may still be on its way
                while len(self._unclaimed) > 64:
                    self._unclaimed.popitem(last=False)
                continue
            if pending.update.transfer.get("transfer") != info.transfer:
                log.info("dropped upload %s from %s: its update announced transfer %s", info.transfer, info.device, pending.update.transfer.get("transfer"))
                continue
            self._accept(info.device, pending, progress)

    def _accept(self, device: str, pending: _Pending, progress: Progress) -> None:
        if pending.settled:
            return
        if progress.status is not Status.COMPLETE or progress.payload is None:
            self.reject(device, progress.reason or f"transfer {progress.status.value}")
            return
        try:
            manifest, state = decode(progress.payload, self.preset, expected=pending.manifest)
        except FeastError as exc:
            self.reject(device, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - whatever an upload holds, it is the upload's fault: refuse it, never stop
            self.reject(device, f"undecodable payload ({type(exc).__name__})")
            return
        if manifest.kind != "update":
            self.reject(device, f"payload kind {manifest.kind!r} is not 'update'")
            return
        assert self.current is not None
        change = update_norm(state, self.current.global_state)
        if self.max_update_norm and not change <= self.max_update_norm:
            self.reject(device, f"its update changes the routed slice by {change:.3g} (L2 norm); the limit is --max-update-norm {self.max_update_norm:g}")
            return
        pending.state = state
        if self.live is not None:
            self.live.upload_done(device, len(progress.payload), progress.info.count)
        log.debug("round %d: valid update from %s (%d samples)", pending.manifest.round + 1, device, pending.update.samples if pending.update else 0)

    def reject(self, device: str, reason: str) -> None:
        """Refuse ``device``'s update of the round in flight; the global model is untouched by it."""
        current = self.current
        if current is None:
            return
        pending = current.pending.get(device)
        if pending is not None and not pending.settled:
            pending.error = reason
        current.collected.rejected[device] = reason
        if self.live is not None:
            self.live.member(device, "rejected", reason=reason)
        log.warning("round %d: rejected the update of %s: %s; the global model is untouched by it", current.t + 1, device, reason)
