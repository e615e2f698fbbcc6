"""The deployment's collector: each cohort device's routed slice out, its valid update back (docs/protocol.md §7).

The run loop (``feast_edge.run.loop.RunLoop``) asks this collector for one
round's updates, exactly as the simulation asks its in-process one:

    per device: route_state -> payload.encode -> RoundStart.from_plan -> exchange.send
    per reply:  decode(upload, expected = the routed manifest), the update-norm bound -> ClientUpdate or rejected
    -> Collected(valid updates, rejected with reasons, missing, dropped, ignored)

Messages, chunks and waiting are ``exchange.RoundExchange``'s; devices that
never reply do not block the round past its ``round_timeout``. What a round
message carries beyond the plain round's, and how an upload is decoded, is the
collector's upload codec: :class:`PlainUploads` (routed slices back as updates),
or a secure round's masked uploads (``secure.MaskedUploads``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from feast_edge.aggregate.robust import update_norm
from feast_edge.errors import FeastError
from feast_edge.local.recipe import TrainConfig
from feast_edge.privacy.local import LocalDp, noised_norm_bound
from feast_edge.protocol import RoundStart, Update
from feast_edge.protocol.features import NO_HORIZON
from feast_edge.route.envelope import route_state
from feast_edge.route.payload import Manifest, decode, encode
from feast_edge.route.plans import ClientPlan
from feast_edge.run.cohort import client_seed
from feast_edge.run.collect import ClientUpdate, Collected
from feast_edge.server.devices import DeviceBook
from feast_edge.server.exchange import DECLINED, REJECTED, Expect, Reply, RoundExchange
from feast_edge.server.live import LiveView
from feast_edge.server.registry import Device, Registry
from feast_edge.space.geometry import Layout
from feast_edge.space.preset import Preset
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.transfer import ChunkReceiver

log = logging.getLogger(__name__)

UPLOAD_SLACK = 4096  # bytes an update's header may exceed the routed one's (the manifest names the device)
ROUTED_CACHE_BYTES = (
    64 * 2**20
)  # routed slices kept for the next devices of the same envelope while a round's payloads go out


@dataclass(frozen=True)
class RoundTerms:
    """What every cohort device is sent with its slice, and what its update is held to."""

    preset: Preset
    train: TrainConfig
    seed: int
    rounds: int  # the horizon; 0: none (--continuous)
    payload_dtype: str = "float32"  # routed payloads go out in it; updates must come back in it
    max_update_norm: float = 0.0  # L2 bound on an update's change of its routed slice (0: none)
    local_dp: LocalDp | None = None  # --dp-mode local: what each device applies to its own update before it leaves

    def round_start(
        self,
        plan: ClientPlan,
        federation: str,
        t: int,
        device: str,
        registered: Device | None,
        transfer: TransferInfo,
        timeout: float,
        lr: float,
        **extra: Any,
    ) -> RoundStart:
        """Round ``t`` of ``device``: its plan, routed transfer, lr, client seed and these terms' training settings
        (``extra``: further RoundStart.from_plan arguments, e.g. a secure round's terms)."""
        return RoundStart.from_plan(
            plan,
            federation=federation,
            round=t,
            device=device,
            instance=registered.instance if registered is not None else "unregistered",
            transfer=transfer,
            sent_at=time.time(),
            timeout=timeout,
            rounds=self.horizon_of(t, registered),
            lr=lr,
            seed=client_seed(self.seed, t, device),
            train=self.train,
            payload_dtype=self.payload_dtype,
            dp=self.local_dp,
            **extra,
        )

    def horizon_of(self, t: int, registered: Device | None) -> int:
        """The ``rounds`` round ``t``'s message carries: the horizon, or without one (0) to an agent that does not list
        the no-horizon feature, t + 1 (its horizon check then accepts the round)."""
        features = registered.profile.get("features") if registered is not None else None
        if self.rounds or (isinstance(features, list) and NO_HORIZON in features):
            return self.rounds
        return t + 1


class _Slices:
    """Devices of one budget share an envelope: its slice of the (unchanging) global state is cut once per round,
    keeping the recent slices up to ROUTED_CACHE_BYTES (at least the last one)."""

    def __init__(self, global_state: Mapping[str, torch.Tensor], preset: Preset) -> None:
        self.global_state, self.preset = global_state, preset
        self._cut: OrderedDict[Layout, dict[str, torch.Tensor]] = OrderedDict()

    def routed(self, layout: Layout) -> dict[str, torch.Tensor]:
        routed = self._cut.get(layout)
        if routed is None:
            routed = self._cut[layout] = route_state(self.global_state, layout, self.preset)
            while len(self._cut) > 1 and sum(_nbytes(r) for r in self._cut.values()) > ROUTED_CACHE_BYTES:
                self._cut.popitem(last=False)
        return routed


class Routed(NamedTuple):
    """What one device was sent: the manifest of its payload and the routed slice it encodes (copies)."""

    manifest: Manifest
    state: dict[str, torch.Tensor]
    at: float  # monotonic: when its round message went out


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


class Uploads(Protocol):
    """A round's upload codec: what the round messages carry beyond the plain round's, and what comes back."""

    def round_extra(self) -> dict[str, Any]:
        """Further RoundStart.from_plan arguments (a secure round's terms)."""

    def expect(self, device: str, blob: bytes, plan: ClientPlan, registered_samples: int) -> Expect:
        """What ``device``'s reply may announce, its routed payload being ``blob``."""

    def check(self, reply: Reply, routed: Manifest, global_state: Mapping[str, torch.Tensor]) -> ClientUpdate | str:
        """``reply``'s upload decoded against the manifest routed to it, or why it is refused."""


class PlainUploads:
    """Each device's routed slice comes back as its update, checked against what it was sent."""

    def __init__(self, terms: RoundTerms, devices: DeviceBook) -> None:
        self.terms, self.devices = terms, devices

    def round_extra(self) -> dict[str, Any]:
        return {}

    def expect(self, device: str, blob: bytes, plan: ClientPlan, registered_samples: int) -> Expect:
        """An update of the size of the routed ``blob``."""
        return Expect(max_bytes=len(blob) + UPLOAD_SLACK, max_samples=registered_samples)

    def check(self, reply: Reply, routed: Manifest, global_state: Mapping[str, torch.Tensor]) -> ClientUpdate | str:
        """``reply``'s upload decoded against the manifest routed to it and held to the update-norm bound (its change
        of ``global_state``, the model it was sent), or why it is refused."""
        assert reply.update is not None and reply.payload is not None
        try:
            manifest, state = decode(reply.payload, self.terms.preset, expected=routed)
        except FeastError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever an upload holds, it is the upload's fault: refuse it, never stop
            return f"undecodable payload ({type(exc).__name__})"
        if manifest.kind != "update":
            return f"payload kind {manifest.kind!r} is not 'update'"
        return update_of(
            reply.device,
            state,
            reply.update,
            global_state,
            self.terms.max_update_norm,
            self_reported=reply.device not in self.devices.shard_samples,
            local_dp=self.terms.local_dp,
        )


class DeviceCollector:
    """Cohorts among online devices; their slices out and their updates back over a :class:`RoundExchange`."""

    def __init__(
        self,
        exchange: RoundExchange,
        devices: DeviceBook,
        terms: RoundTerms,
        live: LiveView | None = None,
        uploads: Uploads | None = None,
    ) -> None:
        self.exchange, self.devices, self.terms = exchange, devices, terms
        self.live = live  # the dashboard's view of the round in flight (feast-server run --dashboard)
        self.uploads = PlainUploads(terms, devices) if uploads is None else uploads

    def with_uploads(self, uploads: Uploads) -> DeviceCollector:
        """This collector with ``uploads`` as its upload codec (a secure round's masked uploads)."""
        return DeviceCollector(self.exchange, self.devices, self.terms, self.live, uploads)

    @property
    def receiver(self) -> ChunkReceiver:
        """The exchange's upload receiver (its reassembler holds what devices are sending)."""
        return self.exchange.receiver

    # ------------------------------------------------------------------ Collector
    def clients(self, needed: int) -> list[str]:
        """Block until ``needed`` registered devices are online."""
        return self.exchange.wait_online(needed, self.devices)

    def fleet(self) -> list[str]:
        """Every registered device, online or not."""
        return [d.device_id for d in self.devices.registry.devices()]

    def budget(self, client: str) -> float:
        return registered_budget(self.devices.registry, client)

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, ClientPlan],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        start = time.monotonic()
        self.devices.coverage.check()  # a label-skewed fleet is said once, in one line per problem, before it trains
        self.exchange.open(t)
        if self.live is not None:
            self.live.round_started(t, cohort, self.exchange.settings.round_timeout)
        routed = self.send(t, cohort, plans, global_state, lr)
        got = Collected([], send_seconds=time.monotonic() - start)
        log.debug("round %d: routed payloads sent to %s", t + 1, ", ".join(cohort))
        valid: dict[str, ClientUpdate] = {}
        for reply in self.exchange.replies():
            if reply.error and reply.outcome != REJECTED:
                self.unsettled(got, t, reply)
                continue
            checked = reply.error or self.uploads.check(reply, routed[reply.device].manifest, global_state)
            if isinstance(checked, str):
                self.reject(got, t, reply.device, checked)
                continue
            valid[reply.device] = checked
            if self.live is not None:
                self.live.upload_done(reply.device, reply.size, reply.chunks)
            log.debug("round %d: valid update from %s (%d samples)", t + 1, reply.device, checked.samples)
        got.updates = [valid[d] for d in sorted(valid)]
        unsettled = self.exchange.close()
        got.missing, got.dropped, got.ignored = unsettled.missing, unsettled.dropped, unsettled.ignored
        return got

    # ------------------------------------------------------------------ the two directions
    def send(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, ClientPlan],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> dict[str, Routed]:
        """Route, encode and send each device its slice with the RoundStart that announces it; what each was sent."""
        terms, exchange = self.terms, self.exchange
        classes, slices, routed = terms.preset.classes, _Slices(global_state, terms.preset), {}
        for device in cohort:
            plan = plans[device]
            manifest = plan.manifest(terms.preset, classes, t, "routed", device, terms.payload_dtype)
            state = slices.routed(plan.layout(terms.preset, classes))
            blob = encode(state, manifest)
            routed[device] = Routed(manifest, state, time.monotonic())
            info = exchange.describe(device, blob)
            registered = self.devices.registry.get(device)
            message = terms.round_start(
                plan, exchange.topics.federation, t, device, registered, info, exchange.time_left(), lr,
                **self.uploads.round_extra(),
            )  # fmt: skip
            expect = self.uploads.expect(device, blob, plan, registered.samples if registered is not None else 0)
            if exchange.send(device, message, blob, info, expect) and self.live is not None:
                self.live.routed(device, len(blob), info.count, plan.envelope.params(terms.preset, classes))
        return routed

    def unsettled(self, got: Collected, t: int, reply: Reply) -> None:
        """``reply``'s device declined the round, or its payload or upload did not get through: no update of it counts."""
        (got.declined if reply.outcome == DECLINED else got.incomplete)[reply.device] = reply.error
        if self.live is not None:
            self.live.member(reply.device, reply.outcome, reason=reply.error)
        log.warning("round %d: no update from %s (%s): %s", t + 1, reply.device, reply.outcome, reply.error)

    def reject(self, got: Collected, t: int, device: str, reason: str) -> None:
        """Refuse ``device``'s update of round ``t``; the global model is untouched by it."""
        got.rejected[device] = reason
        if self.live is not None:
            self.live.member(device, "rejected", reason=reason)
        log.warning(
            "round %d: rejected the update of %s: %s; the global model is untouched by it", t + 1, device, reason
        )


def update_of(
    device: str,
    state: dict[str, torch.Tensor],
    update: Update,
    global_state: Mapping[str, torch.Tensor],
    max_update_norm: float,
    *,
    self_reported: bool,
    local_dp: LocalDp | None = None,
) -> ClientUpdate | str:
    """A decoded, envelope-checked update of ``device`` held to the update-norm bound, or why it is refused.

    Under local DP the device's noise is part of its change: the bound is the larger of ``--max-update-norm`` and
    what an honest noised update of this size can reach (``feast_edge.privacy.local.noised_norm_bound``)."""
    change = update_norm(state, global_state)
    if local_dp is not None and max_update_norm:
        numel = sum(x.numel() for x in state.values() if x.is_floating_point())
        max_update_norm = max(max_update_norm, noised_norm_bound(local_dp, numel))
    if max_update_norm and not change <= max_update_norm:
        return f"its update changes the routed slice by {change:.3g} (L2 norm); the limit is --max-update-norm {max_update_norm:g}"
    return ClientUpdate(
        device,
        state,
        update.samples,
        loss=update.loss,
        samples_seen=update.samples_seen,
        train_macs=update.train_macs,
        compute_seconds=update.compute_seconds,
        self_reported=self_reported,
    )


def registered_budget(registry: Registry, client: str) -> float:
    """The MAC budget ``client`` registered with (a sampled client always has one)."""
    device = registry.get(client)
    assert device is not None, f"{client} was sampled but is not registered"
    return float(device.budget_macs)
