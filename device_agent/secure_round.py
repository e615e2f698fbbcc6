"""The agent's side of secure aggregation (feast_edge.secagg over MQTT, docs/protocol.md §8): keys, shares and the
unmasking answered by a worker thread at once, whatever the agent's thread is doing (training this client or another),
and the masked upload built by the agent's thread after training.

    paho's thread   a secure RoundStart or a stage message -> the worker's queue
    worker thread   RoundStart: new keys, SecAggKeys out       SecAggRoster: sealed shares + commitments out
                    SecAggBox: open the shares addressed here  SecAggUnmask: the shares that unmask the sum out
    agent thread    after training: wait for the box, encode w · (θ' - θ_t) per segment, mask it: the upload

A device never reveals both shares of one device (Device.unmask refuses), answers one unmask request a round (a
second one is refused, and the log says so), never answers for a round it holds no keys of or sent no masked update
in, and keeps the parties of its last few rounds only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from feast_edge.errors import FeastError
from feast_edge.privacy.local import parameter_names
from feast_edge.protocol import (
    RoundStart,
    SecAggBox,
    SecAggKeys,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
    SecureBlock,
)
from feast_edge.protocol.secure import sealed_wire
from feast_edge.secagg.fixed import FixedPoint
from feast_edge.secagg.keys import shamir
from feast_edge.secagg.masked import encode_masked
from feast_edge.secagg.protocol import Device, SecAggError
from feast_edge.secagg.sums import SecureTerms, cohort_segments, dp_input, encode_change
from feast_edge.space.preset import Preset
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics

log = logging.getLogger(__name__)

KEPT = 8  # rounds whose parties a worker keeps (per agent)
Stage = SecAggRoster | SecAggBox | SecAggUnmask


@dataclass
class Party:
    """One hosted client's side of one secure round."""

    start: RoundStart
    block: SecureBlock
    device: Device
    segments: dict
    code: FixedPoint
    boxed: threading.Event = field(default_factory=threading.Event)
    shared: tuple[str, ...] = ()
    bad: list[str] = field(default_factory=list)  # senders whose shares did not open
    masked: bool = False  # this device sent its masked update
    answered: bool = False  # this device revealed its shares for the round (it never does twice)


class SecureRounds:
    """The secure rounds of an agent's hosted clients: a worker thread for the stages, the masking for the agent."""

    def __init__(self, preset: Preset, link: Link, topics: Topics, stop: threading.Event) -> None:
        self.preset, self.link, self.topics, self.stop = preset, link, topics, stop
        self._queue: queue.Queue[RoundStart | Stage] = queue.Queue(maxsize=1000)
        self._parties: OrderedDict[str, Party] = OrderedDict()  # routed transfer id -> party
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ paho's thread
    def offer(self, message: RoundStart | Stage) -> None:
        """Queue a secure round's start or stage message for the worker (started on the first)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="feast-secagg", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            log.warning("secure aggregation: too many stage messages queued; dropped a %s", message.kind)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        while not self.stop.is_set():
            try:
                message = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._handle(message)
            except (FeastError, SecAggError, ProtocolError, ValueError) as exc:
                log.warning("secure aggregation: %s for %s refused: %s", message.kind, message.device, exc)
            except Exception:  # a bug must not end the worker: the round goes on without this device's stage
                log.exception("secure aggregation: %s for %s failed", message.kind, message.device)

    def _handle(self, message: RoundStart | Stage) -> None:
        if isinstance(message, RoundStart):
            self._advertise(message)
            return
        with self._lock:
            party = self._parties.get(message.routed)
        if party is None or party.start.device != message.device or party.start.round != message.round:
            log.info("secure aggregation: ignored %s for %s: no such secure round here", message.kind, message.device)
            return
        if isinstance(message, SecAggRoster):
            self._share(party, message)
        elif isinstance(message, SecAggBox):
            self._open(party, message)
        else:
            self._reveal(party, message)

    def _advertise(self, start: RoundStart) -> None:
        block = start.secure_block()
        assert block is not None
        shamir()  # without PyCryptodome: no keys (the server leaves this device out), and the fix in the log
        terms = SecureTerms(block.colluders, block.bound, block.degree)
        try:
            segments = cohort_segments(self.preset, block.cohort)
        except (FeastError, ValueError, KeyError, IndexError) as exc:
            raise ProtocolError(f"its cohort's envelopes do not fit preset {self.preset.name}: {exc}") from None
        setup = terms.setup(f"{start.federation}/round {start.round}", segments, len(block.cohort), block.degree)
        if setup.threshold != block.threshold:
            raise ProtocolError(f"threshold {block.threshold} is not t = {setup.threshold} for this cohort and c")
        party = Party(start, block, Device(start.device, setup, {}), segments, FixedPoint(block.bound, block.frac))
        with self._lock:
            self._parties[start.transfer["transfer"]] = party
            while len(self._parties) > KEPT:
                self._parties.popitem(last=False)
        c_key, s_key = party.device.advertise()
        self._send(start.device, SecAggKeys, start, c_key=c_key.hex(), s_key=s_key.hex())
        log.info(
            "round %d: %s takes part in secure aggregation (%d segments, t = %d, c = %d)",
            start.round + 1,
            start.device,
            len(setup.routed(start.device)),
            setup.threshold,
            block.colluders,
        )

    def _share(self, party: Party, roster: SecAggRoster) -> None:
        keys = roster.roster()
        if party.start.device not in keys or party.device.roster:
            raise ProtocolError("a roster without this device, or a second roster for the round")
        if keys[party.start.device] != party.device.advertise():
            raise ProtocolError("the roster gives this device keys it did not advertise")
        sealed = party.device.share(keys)
        commitments = party.device.commitments()
        self._send(party.start.device, SecAggShares, party.start, shares=sealed_wire(sealed), commitments=commitments)

    def _open(self, party: Party, box: SecAggBox) -> None:
        if party.boxed.is_set() or party.start.device not in box.shared or not party.device.roster:
            raise ProtocolError("a second box, a box that leaves this device out, or one before its shares")
        if not set(box.shared) <= set(party.device.roster):
            raise ProtocolError("the box names devices that never advertised keys")
        party.bad = party.device.receive(box.sealed())
        if party.bad:
            log.warning("round %d: the shares of %s did not open", party.start.round + 1, ", ".join(party.bad))
        party.shared = box.shared
        party.boxed.set()

    def _reveal(self, party: Party, request: SecAggUnmask) -> None:
        # One answer per round: two answers to requests naming different devices could give the server both shares
        # of one device, the s key's and the b seed's, and with them its update.
        if party.answered:
            raise ProtocolError(
                f"a second unmask request for round {party.start.round + 1}: this device already revealed its shares "
                "for that round and never reveals twice"
            )
        if not party.masked:
            raise ProtocolError("an unmask request for a round this device sent no masked update in")
        revealed = party.device.unmask(request.masked)
        self._send(party.start.device, SecAggReveal, party.start, shares=SecAggReveal.wire(revealed))
        party.answered = True

    def _send(self, device: str, kind: type, start: RoundStart, **fields: object) -> None:
        message = kind(
            federation=start.federation, round=start.round, device=device, routed=start.transfer["transfer"], **fields
        )
        self.link.publish(self.topics.events(device), message.encode())

    # ------------------------------------------------------------------ the agent's thread
    def masked_upload(
        self,
        start: RoundStart,
        base: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor],
        deadline: float,
        abandon: Callable[[], bool],
    ) -> bytes | str:
        """The masked upload of ``state`` (θ') against ``base`` (θ_t) once the share box came, or why there is none."""
        with self._lock:
            party = self._parties.get(start.transfer["transfer"])
        if party is None:
            return "this device holds no keys for the round (its round message came before a restart?)"
        while not party.boxed.wait(0.2):
            if time.monotonic() > deadline or abandon():
                return "the server sent no share box before the round's deadline (this device shared too late?)"
        if party.block.clip is not None:  # central DP: the parameters' change clipped, the rest global, then masked
            state = dp_input(base, state, parameter_names(self.preset), party.block.clip)
        weight, inputs, clipped = party.block.weight(start.device), {}, 0
        for sid in party.device.setup.routed(start.device):
            inputs[sid], over = encode_change(party.segments[sid], base, state, weight, party.code)
            clipped += over
        if clipped:
            log.warning("round %d: %d values clipped to ±%g before masking", start.round + 1, clipped, party.code.bound)
        party.device.inputs = inputs
        masked = party.device.mask(party.shared)
        integers = {n: t for n, t in state.items() if not torch.is_floating_point(t)}
        party.masked = True
        return encode_masked(masked, integers, start.round, start.device)
