"""Secure aggregation over MQTT (feast-server run --secure-agg; docs/protocol.md §8): the server routes the stages of
feast_edge.secagg.protocol between the cohort devices and unmasks only per-segment sums.

    RoundStart (secure terms)  ->  keys (stage 1, as devices receive the round)  ->  roster to U1
    sealed shares (stage 2)    ->  each device's box (U2)     ... the devices train, mask, upload (the round's wait)
    the masked uploads (U3)    ->  unmask request to U3       ->  revealed shares (stage 4)  ->  the segments' sums

:class:`SecureStages` holds one round's stages (the events route its messages while the round is open);
:class:`MaskedUploads` is the device collector's upload codec for the masked uploads; :class:`MqttSecureSums` is the
sums transport of feast_edge.run.sums.Summed that opens the stages, unmasks and releases (``mqtt_secure_sums``
builds it; its in-process twin is feast_edge.secagg.collector).

Each key stage ends when every device still in the round answered or ``--secagg-timeout`` passed; a device that
misses a stage is out of the round (the exchange stops waiting for it), and the survivors go on as SecAgg allows:
fewer than t devices at a stage withholds the round, with the reason. The round's wait for the masked uploads is the
plain round's (``--round-timeout``). Messages are taken only from the device they name, answering the routed transfer
the device was sent, once per stage.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from feast_edge.aggregate.checks import StateDict
from feast_edge.aggregate.segments import Segment, SegmentSums
from feast_edge.aggregate.weights import weight_cap
from feast_edge.errors import FeastError
from feast_edge.privacy.settings import DpSettings
from feast_edge.protocol import SecAggBox, SecAggKeys, SecAggReveal, SecAggRoster, SecAggShares, SecAggUnmask
from feast_edge.protocol.secure import SecureBlock, sealed_wire
from feast_edge.route.payload import Manifest, integer_shapes
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import ClientUpdate, Collected
from feast_edge.run.sums import Summed
from feast_edge.secagg.fixed import FixedPoint
from feast_edge.secagg.masked import decode_masked, upload_bound
from feast_edge.secagg.protocol import Setup, unmasked_sums
from feast_edge.secagg.sums import SecureTerms, cohort_segments, masked_clip, release
from feast_edge.server.collect import DeviceCollector
from feast_edge.server.config import SecureRounds
from feast_edge.server.events import Events
from feast_edge.server.exchange import Expect, Reply
from feast_edge.space.preset import Preset
from feast_edge.transport.messages import Message
from feast_edge.util.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

SECURE = "secure.json"  # the stage of the secure round in flight, for feast-server status


def write_stage(out: Path, t: int, stage: str, detail: str) -> None:
    """SECURE in ``out``, atomically: the secure round's stage (``feast-server status``)."""
    record = {"updated": time.time(), "round": t + 1, "stage": stage, "detail": detail}
    atomic_write_bytes(out / SECURE, json.dumps(record, sort_keys=True).encode())


def read_stage(out: Path) -> dict[str, Any] | None:
    """SECURE of the run in ``out``, or None (no secure round yet, or an unreadable file)."""
    try:
        record = json.loads((out / SECURE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def stage_line(state: dict[str, Any]) -> str:
    return f"secure aggregation: round {state.get('round')}: {state.get('stage')} ({state.get('detail')})"


class SecureStages:
    """One secure round's stages at the server: what each device advertised, shared and revealed."""

    def __init__(
        self,
        setup: Setup,
        federation: str,
        t: int,
        routed_of: Callable[[str], str | None],
        send: Callable[[str, Message], None],
        give_up: Callable[[str, str], None],
        timeout: float,
        show: Callable[[str, str], None] = lambda stage, detail: None,
    ) -> None:
        self.setup, self.federation, self.t = setup, federation, t
        self.routed_of, self.send, self.give_up, self.timeout, self.show = routed_of, send, give_up, timeout, show
        self.cohort = sorted({m for members, _ in setup.segments.values() for m in members})
        self.stage, self.deadline = "keys", time.monotonic() + timeout
        self.failed = ""  # why the round cannot be unmasked (fewer than t devices at a stage)
        self.routed: dict[str, str] = {}  # device -> the routed transfer of its round (from its keys on)
        self.keys: dict[str, tuple[bytes, bytes]] = {}  # U1
        self.sealed: dict[str, dict[str, bytes]] = {}  # sender -> recipient -> sealed share (U2)
        self.commitments: dict[str, dict[str, str]] = {}
        self.shared: tuple[str, ...] = ()
        self.masked: dict[str, dict[str, Any]] = {}  # U3: device -> segment -> its masked values
        self.revealed: dict[str, dict[str, dict[str, Any]]] = {}
        self.show(self.stage, f"waiting for {len(self.cohort)} devices' keys")

    # ------------------------------------------------------------------ messages (the run thread's event loop)
    def on_message(self, message: Message) -> None:
        routed = self.routed.get(message.device) or self.routed_of(message.device)
        if message.round != self.t or routed is None or getattr(message, "routed", None) != routed:
            self._ignore(message, "it does not answer this device's secure round in flight")
        elif isinstance(message, SecAggKeys):
            self._on_keys(message)
        elif isinstance(message, SecAggShares):
            self._on_shares(message)
        elif isinstance(message, SecAggReveal):
            self._on_reveal(message)

    def _ignore(self, message: Message, why: str) -> None:
        log.info("round %d: ignored %s from %s: %s", self.t + 1, message.kind, message.device, why)

    def _on_keys(self, message: SecAggKeys) -> None:
        if self.stage != "keys" or message.device in self.keys:
            self._ignore(message, f"keys are taken once, in the key stage (now: {self.stage})")
            return
        self.keys[message.device], self.routed[message.device] = message.keys(), message.routed
        if len(self.keys) == len(self.cohort):
            self._roster()

    def _on_shares(self, message: SecAggShares) -> None:
        sender = message.device
        if self.stage != "shares" or sender not in self.keys or sender in self.sealed:
            self._ignore(message, f"shares are taken once from a device of the roster (now: {self.stage})")
            return
        sealed = message.sealed()
        holders = self.setup.holders(sender)
        expected = (set(self.keys) if holders is None else set(holders) & set(self.keys)) - {sender}
        if set(sealed) != expected or set(message.commitments) != set(self.setup.routed(sender)):
            self._ignore(message, "it must seal one share for each other device of the roster that holds its shares "
                         "and commit to a seed for each segment it is routed")  # fmt: skip
            return
        self.sealed[sender], self.commitments[sender] = sealed, dict(message.commitments)
        if len(self.sealed) == len(self.keys):
            self._boxes()

    def _on_reveal(self, message: SecAggReveal) -> None:
        device = message.device
        if self.stage != "unmask" or device not in self.masked or device in self.revealed:
            self._ignore(message, f"shares are revealed once by a device that masked (now: {self.stage})")
            return
        opened = message.opened()
        for owner, share in opened.items():
            dropped = owner in self.shared and owner not in self.masked
            if owner not in self.shared or ("s" in share) != dropped:
                self._ignore(message, f"it reveals {'an s-key' if 's' in share else 'seed'} share of {owner}, "
                             "which the unmask request does not ask for")  # fmt: skip
                return
        self.revealed[device] = opened

    # ------------------------------------------------------------------ stage changes
    def tick(self) -> None:
        """End a key stage whose deadline passed."""
        if time.monotonic() < self.deadline:
            return
        if self.stage == "keys":
            self._roster()
        elif self.stage == "shares":
            self._boxes()

    def _out(self, devices: Sequence[str], why: str) -> None:
        for device in devices:
            log.warning("round %d: %s is out of the secure round: %s", self.t + 1, device, why)
            self.give_up(device, f"secure aggregation: {why}")

    def _fail(self, why: str) -> None:
        self.failed, self.stage = why, "done"
        log.warning("round %d: secure aggregation cannot unmask this round: %s", self.t + 1, why)
        self.show("failed", why)
        self._out([d for d in self.cohort], why)

    def _roster(self) -> None:
        late = [d for d in self.cohort if d not in self.keys]
        if len(self.keys) < self.setup.threshold:
            self._fail(f"{len(self.keys)} of {len(self.cohort)} devices advertised keys; t = {self.setup.threshold}")
            return
        self._out(late, f"it advertised no keys within {self.timeout:g} s")
        keys = {d: [c.hex(), s.hex()] for d, (c, s) in sorted(self.keys.items())}
        for device in self.keys:
            self.send(device, SecAggRoster(federation=self.federation, round=self.t, device=device,
                                           routed=self.routed[device], keys=keys))  # fmt: skip
        self.stage, self.deadline = "shares", time.monotonic() + self.timeout
        self.show(self.stage, f"{len(self.keys)} devices advertised keys; waiting for their sealed shares")

    def _boxes(self) -> None:
        late = [d for d in self.keys if d not in self.sealed]
        if len(self.sealed) < self.setup.threshold:
            self._fail(f"{len(self.sealed)} of {len(self.keys)} devices shared their keys; t = {self.setup.threshold}")
            return
        self._out(late, f"it sent no sealed shares within {self.timeout:g} s")
        self.shared = tuple(sorted(self.sealed))
        for device in self.shared:
            mine = {sender: boxes[device] for sender, boxes in self.sealed.items() if device in boxes}
            box = SecAggBox(federation=self.federation, round=self.t, device=device, routed=self.routed[device],
                            shared=self.shared, shares=sealed_wire(mine))  # fmt: skip
            self.send(device, box)
        self.stage = "masking"
        self.show(self.stage, f"{len(self.shared)} devices shared; they train and upload their masked updates")

    def expected(self, device: str) -> dict[str, int]:
        """The segments ``device`` must upload (those with at least min_members members that shared): id -> values."""
        return {
            s: self.setup.segments[s][1]
            for s in self.setup.routed(device)
            if sum(m in self.shared for m in self.setup.members(s)) >= self.setup.min_members
        }

    # ------------------------------------------------------------------ the unmask stage (after the round's wait)
    def unmask(self, masked: Mapping[str, Mapping[str, Any]], pump: Callable[[float], None]) -> dict[str, Any]:
        """Ask every device of U3 = ``masked`` for its shares, wait for them (``--secagg-timeout``), and return each
        segment's unmasked sum (uint32) or why it stays masked."""
        self.masked = dict(masked)
        if self.failed:
            return {s: self.failed for s in self.setup.segments}
        if len(self.masked) < self.setup.threshold:
            why = f"{len(self.masked)} masked updates arrived; unmasking needs t = {self.setup.threshold}"
            self.failed, self.stage = why, "done"
            self.show("failed", why)
            return {s: why for s in self.setup.segments}
        self.stage, self.deadline = "unmask", time.monotonic() + self.timeout
        self.show(self.stage, f"{len(self.masked)} masked updates in; waiting for the shares that unmask their sums")
        names = tuple(sorted(self.masked))
        for device in names:
            self.send(device, SecAggUnmask(federation=self.federation, round=self.t, device=device,
                                           routed=self.routed[device], masked=names))  # fmt: skip
        while len(self.revealed) < len(names) and time.monotonic() < self.deadline:
            pump(min(0.1, max(0.0, self.deadline - time.monotonic())))
        missing = [d for d in names if d not in self.revealed]
        if missing:
            log.warning("round %d: no shares from %s (dropped after masking)", self.t + 1, ", ".join(missing))
        self.stage = "done"
        began = time.perf_counter()
        sums = unmasked_sums(self.setup, self.keys, self.shared, self.masked, self.revealed, self.commitments)
        self.show("done", f"{len(self.revealed)} of {len(names)} devices revealed shares; unmasked in "
                  f"{time.perf_counter() - began:.2f} s")  # fmt: skip
        return sums


class MaskedUploads:
    """DeviceCollector's upload codec in a secure round: the round's terms go out with each round message, and each
    upload is a masked update (feast_edge.secagg.masked), decoded and kept for the unmask stage."""

    def __init__(self, preset: Preset) -> None:
        self.preset = preset
        self.block: SecureBlock | None = None
        self.stages: SecureStages | None = None
        self.masked: dict[str, dict[str, Any]] = {}  # device -> segment -> its masked values
        self.integers: dict[str, dict[str, torch.Tensor]] = {}  # device -> its integer tensors (BN counters)

    def begin(self, block: SecureBlock, stages: SecureStages) -> None:
        """A new round's terms and stages; nothing uploaded yet."""
        self.block, self.stages, self.masked, self.integers = block, stages, {}, {}

    def round_extra(self) -> dict[str, Any]:
        return {"secure": self.block}

    def expect(self, device: str, blob: bytes, plan: ClientPlan, registered_samples: int) -> Expect:
        """A masked upload of the segments ``device`` is routed, and its integer tensors."""
        assert self.stages is not None, "begin() sets up the round first"
        lengths = {s: self.stages.setup.segments[s][1] for s in self.stages.setup.routed(device)}
        ints = integer_shapes(self.preset, plan.envelope)
        return Expect(max_bytes=upload_bound(lengths, ints), max_samples=registered_samples)

    def check(self, reply: Reply, routed: Manifest, global_state: Mapping[str, torch.Tensor]) -> ClientUpdate | str:
        """What ``reply`` reported (its state stays masked, kept here), or why its masked upload is refused."""
        assert reply.update is not None and reply.payload is not None
        assert self.stages is not None and self.block is not None, "begin() sets up the round first"
        if reply.device not in self.stages.shared:
            return "it uploaded a masked update but is not among the devices that shared their keys"
        try:
            ints = integer_shapes(self.preset, routed.envelope)
            masked, integers = decode_masked(
                reply.payload, self.stages.expected(reply.device), ints, reply.update.round, reply.device
            )
        except FeastError as exc:
            return str(exc)
        self.masked[reply.device], self.integers[reply.device] = masked, integers
        update = reply.update
        return ClientUpdate(
            reply.device,
            {},
            1 if self.block.clip is not None else self.block.counts[reply.device],  # central DP: 1 each
            loss=update.loss,
            samples_seen=update.samples_seen,
            train_macs=update.train_macs,
            compute_seconds=update.compute_seconds,
        )


class MqttSecureSums:
    """Sums transport over MQTT: the key stages run while the cohort trains, the masked uploads come back through
    ``uploads`` (the device collector's codec), and the unmask stage releases the per-segment sums."""

    def __init__(
        self,
        collector: DeviceCollector,
        uploads: MaskedUploads,
        terms: SecureTerms,
        timeout: float,
        publish: Callable[[str, bytes], object],
        events: Events,
        out: Path,
        weight_ratio: float = 0.0,
        clip: float | None = None,
    ) -> None:
        """``weight_ratio`` (--max-weight-ratio): self-reported counts are capped before they weigh; ``clip``
        (central DP; None: no DP): each device clips before masking, the release stage noises the sums."""
        self.collector, self.uploads, self.terms, self.timeout = collector, uploads, terms, timeout
        self.publish, self.events, self.out, self.weight_ratio, self.clip = publish, events, out, weight_ratio, clip
        self._t = 0
        self._round: tuple[SecureStages, dict[str, Segment], FixedPoint] | None = None
        self._routing = ExitStack()  # the events' routing of the stage messages, while a round is open

    def counts(self, cohort: Sequence[str]) -> dict[str, int]:
        """Each device's aggregation count: registered, capped like a plain round's self-reported counts."""
        registry, shards = self.collector.devices.registry, self.collector.devices.shard_samples
        counts = {d: max(1, registry.get(d).samples) for d in cohort}  # type: ignore[union-attr]
        cap = weight_cap(list(counts.values()), self.weight_ratio)
        return {d: n if cap is None or d in shards else min(n, cap) for d, n in counts.items()}

    def open(
        self, t: int, cohort: Sequence[str], plans: Mapping[str, ClientPlan], global_state: Mapping[str, torch.Tensor]
    ) -> None:
        exchange, terms = self.collector.exchange, self.terms
        envelopes = {d: plans[d].envelope for d in cohort}
        segments = cohort_segments(self.collector.terms.preset, envelopes)
        federation = exchange.topics.federation
        setup = terms.setup(f"{federation}/round {t}", segments, len(cohort))
        code = terms.code(len(cohort))
        block = SecureBlock(
            terms.colluders, setup.threshold, terms.bound, code.frac, envelopes, self.counts(cohort), setup.degree,
            self.clip,
        )  # fmt: skip
        self._t = t
        stages = SecureStages(
            setup,
            federation,
            t,
            exchange.routed_of,
            lambda device, message: self.publish(exchange.topics.ctrl(device), message.encode()),
            exchange.give_up,
            self.timeout,
            show=self._show,
        )
        self.uploads.begin(block, stages)
        self._round = stages, segments, code
        self._routing.enter_context(self.events.secure_round(stages))

    def sums(self, t: int, got: Collected, global_state: StateDict) -> Collected:
        assert self._round is not None, "open() starts the round first"
        stages, segments, code = self._round
        contributors = {u.client for u in got.updates}
        masked = {d: m for d, m in self.uploads.masked.items() if d in contributors}
        unmasked = stages.unmask(masked, self.events.pump)
        released, withheld = release(segments, unmasked, global_state, code)
        for members, reason in withheld.items():
            log.info("round %d: the segment of %s keeps its global value: %s", t + 1, members, reason)
        integers = [self.uploads.integers[d] for d in sorted(masked) if self.uploads.integers.get(d)]
        return replace(got, sums=SegmentSums(released, integers), withheld=withheld)

    def close(self) -> None:
        self._routing.close()
        self._round = None

    def _show(self, stage: str, detail: str) -> None:
        log.info("round %d: secure aggregation: %s: %s", self._t + 1, stage, detail)
        write_stage(self.out, self._t, stage, detail)
        if self.collector.live is not None:
            self.collector.live.secure_stage(stage, detail)


def mqtt_secure_sums(
    inner: DeviceCollector,
    secure: SecureRounds,
    dp: DpSettings | None,
    *,
    publish: Callable[[str, bytes], object],
    events: Events,
    out: Path,
    weight_ratio: float = 0.0,
) -> Summed:
    """``inner``'s rounds as securely aggregated per-segment sums, masked by the devices over MQTT.

    Args:
        inner: the device collector whose cohort trains; its uploads become masked ones.
        secure: c, the clipping bound B, the neighbour graph's degree and each key stage's wait (``--secagg-*``).
        dp: the run's DP settings: under central DP every device clips its parameters' change before masking.
        publish: sends a stage message to a device's control topic.
        events: the server's event loop, which routes the stage messages to the round in flight and pumps.
        out: the run directory (the stage in flight, for ``feast-server status``).
        weight_ratio: ``--max-weight-ratio``: registered counts are capped like a plain round's self-reported ones.
    """
    uploads = MaskedUploads(inner.terms.preset)
    collector = inner.with_uploads(uploads)
    terms = SecureTerms(secure.colluders, secure.secagg_bound, secure.secagg_neighbours)
    transport = MqttSecureSums(
        collector, uploads, terms, secure.secagg_timeout, publish, events, out, weight_ratio, masked_clip(dp)
    )
    return Summed(collector, transport)
