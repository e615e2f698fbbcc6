"""A round's per-segment sums through secure aggregation (feast_edge.secagg.protocol): the encoding every device
applies, the release the server makes of the unmasked sums, and both in one process (:func:`secure_sums`, what
``feast-edge simulate --secure-agg`` releases; the MQTT stages, feast_edge.server.secure, use the same pieces).

Each device encodes, per segment it is routed, its weighted change w · (θ' - θ_t) on the segment's cells and its
weight w = n / n_max (the cohort's largest registered count is public: the registry), clipped to ±``bound`` per
value, in 32-bit fixed point; the weight rides as the last value, so W = Σ w is summed securely too. The server
unmasks S = Σ w(θ' - θ_t) and W, and releases θ_t + S / W on the segment (as S_s / W_s over n_i θ'_i: the same mean).
A segment masked by fewer than c + 2 devices is withheld and keeps θ_t, with the reason.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from feast_edge.aggregate.checks import StateDict
from feast_edge.aggregate.segments import (
    Segment,
    SegmentSum,
    SegmentSums,
    _index,
    segment_id,
    segment_values,
    segments_of,
    segments_over,
)
from feast_edge.privacy.mechanism import private_update
from feast_edge.privacy.settings import DpSettings
from feast_edge.route.envelope import Envelope
from feast_edge.route.payload import expected_shapes
from feast_edge.secagg.fixed import DEFAULT_BOUND, FixedPoint
from feast_edge.secagg.protocol import Device, Setup, degree_for, threshold_for, unmasked_sums
from feast_edge.space.preset import Preset


@dataclass(frozen=True)
class SecureTerms:
    """What every party of a secure round agrees on: c, the clipping bound and the neighbour graph's degree asked for
    (0: chosen from the cohort's size, feast_edge.secagg.protocol.degree_for), and from them t, the smallest revealed
    segment and the fixed-point encoding of a cohort."""

    colluders: int = 1
    bound: float = DEFAULT_BOUND
    neighbours: int = 0

    @property
    def min_members(self) -> int:
        return self.colluders + 2

    def setup(self, context: str, segments: Mapping[str, Segment], cohort: int, degree: int | None = None) -> Setup:
        """The round's setup; ``degree``: the graph's, as the server resolved it (a device takes the round's)."""
        lengths = {sid: segment_values(seg) + 1 for sid, seg in segments.items()}  # + the weight
        degree = degree_for(cohort, self.neighbours) if degree is None else degree
        # t: a majority of the cohort with every device holding every other's shares; with a sparse graph each
        # device's own (Setup.threshold_of), and a round needs at least c + 2 devices at every stage.
        threshold = threshold_for(cohort, self.colluders) if not degree else self.min_members
        return Setup(
            context,
            {sid: (seg.members, lengths[sid]) for sid, seg in segments.items()},
            threshold,
            self.min_members,
            degree,
        )

    def code(self, cohort: int) -> FixedPoint:
        return FixedPoint.for_sum(cohort, self.bound)


def named(segments: Sequence[Segment]) -> dict[str, Segment]:
    """The segments by their ids (feast_edge.aggregate.segments.segment_id)."""
    return {segment_id(s.members): s for s in segments}


def cohort_segments(preset: Preset, cohort: Mapping[str, Envelope]) -> dict[str, Segment]:
    """The segments of a cohort routed these envelopes (device -> envelope), by id: what the server and every device
    of a secure round derive alike from the round's public terms (feast_edge.protocol.secure.SecureBlock)."""
    routed = {d: expected_shapes(preset, preset.classes, e) for d, e in cohort.items()}
    names = {n for shapes in routed.values() for n in shapes if not n.endswith("num_batches_tracked")}
    return named(segments_over(names, routed))


def _parts(segment: Segment) -> list[tuple[str, tuple]]:
    return [(name, cell) for name, cells in segment.cells.items() for cell in cells]


def encode_change(
    segment: Segment,
    base: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    weight: float,
    code: FixedPoint,
) -> tuple[np.ndarray, int]:
    """One device's input to ``segment``: w · (θ' - θ_t) on its cells, then w, encoded; and how many values were
    clipped. ``base`` (θ_t) and ``state`` (θ') may be the routed slice or the global state: cells are leading-slice
    coordinates, the same in both."""
    change = [
        (weight * (state[n][_index(cell)].double() - base[n][_index(cell)].double())).flatten().numpy()
        for n, cell in _parts(segment)
    ]
    values = np.concatenate([*change, [weight]])
    return code.encode(values), int(np.count_nonzero(np.abs(values) > code.bound))


def release(
    segments: Mapping[str, Segment],
    unmasked: Mapping[str, np.ndarray | str],
    global_state: Mapping[str, torch.Tensor],
    code: FixedPoint,
) -> tuple[list[SegmentSum], dict[str, str]]:
    """The sums S_s = Σ w θ' and W_s of each unmasked segment, and why each other one is withheld (members -> reason)."""
    released, withheld = [], {}
    for sid, segment in segments.items():
        result = unmasked.get(sid, "no device masked it")
        if isinstance(result, str):
            withheld[", ".join(segment.members)] = result
            continue
        decoded = code.decode(result)
        weight, offset, values = float(decoded[-1]), 0, {}
        if not weight > 0:
            withheld[", ".join(segment.members)] = f"its summed weight is {weight:g}; weights must be > 0"
            continue
        for n, cell in _parts(segment):
            base = global_state[n][_index(cell)].double()
            size = base.numel()
            change = torch.from_numpy(decoded[offset : offset + size].copy()).reshape(base.shape)
            values.setdefault(n, []).append(change + weight * base)  # S = Σ w θ' = Σ w (θ' - θ_t) + W θ_t
            offset += size
        released.append(SegmentSum(segment, weight, values))
    return released, withheld


@dataclass
class SecureRound:
    """What a secure round released and withheld, and what it cost."""

    sums: SegmentSums
    withheld: dict[str, str] = field(default_factory=dict)  # members (comma-joined) -> why their segment kept θ_t
    clipped: int = 0  # values beyond ±bound, clipped before encoding
    upload_values: dict[str, int] = field(default_factory=dict)  # device -> 32-bit values it uploaded
    share_bytes: dict[str, int] = field(default_factory=dict)  # device -> sealed key shares it sent (key material)
    seconds: dict[str, float] = field(default_factory=dict)  # "devices" (all of them, in turn) and "server"
    server_peak: int = 0  # bytes the server's unmasking and release allocated at most (``trace_memory``)


def secure_sums(
    global_state: StateDict,
    updates: Sequence[tuple[str, StateDict, float]],
    *,
    colluders: int = 1,
    bound: float = DEFAULT_BOUND,
    context: str = "simulation",
    neighbours: int = 0,
    trace_memory: bool = False,
    clip: float | None = None,
    params: Collection[str] = (),
) -> SecureRound:
    """The per-segment sums of ``updates`` (client, routed state, n_i) as the server unmasks them (see the module
    docstring); every device of ``updates`` takes part in every stage. ``trace_memory``: measure the server's peak
    allocation (tracemalloc, which slows the server's part several times). ``clip`` (central DP): each device clips
    its change of ``params`` to L2 norm ``clip`` and keeps the other tensors global before masking, with weight 1."""
    terms = SecureTerms(colluders, bound, neighbours)
    states = {c: s for c, s, _ in updates}
    n_max = max(float(n) for _, _, n in updates)
    weights = {c: float(n) / n_max for c, _, n in updates}
    if clip is not None:
        states = {c: dp_input(global_state, s, params, clip) for c, s in states.items()}
        weights = dict.fromkeys(states, 1.0)
    routed = {c: {name: tuple(t.shape) for name, t in s.items()} for c, s in states.items()}
    segments = named(segments_of(global_state, routed))
    code = terms.code(len(states))
    inputs: dict[str, dict[str, np.ndarray]] = {c: {} for c in states}
    clipped = 0
    for sid, segment in segments.items():
        for c in segment.members:
            inputs[c][sid], over = encode_change(segment, global_state, states[c], weights[c], code)
            clipped += over
    setup = terms.setup(context, segments, len(states))
    began = time.perf_counter()
    devices = {c: Device(c, setup, inputs[c]) for c in sorted(states)}
    roster = {c: d.advertise() for c, d in devices.items()}
    sealed = {c: d.share(roster) for c, d in devices.items()}
    commitments = {c: d.commitments() for c, d in devices.items()}
    for c, d in devices.items():
        d.receive({sender: boxes[c] for sender, boxes in sealed.items() if c in boxes})
    shared = sorted(devices)
    masked = {c: d.mask(shared) for c, d in devices.items()}
    revealed = {c: d.unmask(sorted(masked)) for c, d in devices.items()}
    on_devices = time.perf_counter() - began
    if trace_memory:
        tracemalloc.start()
    unmasked = unmasked_sums(setup, roster, shared, masked, revealed, commitments)
    released, withheld = release(segments, unmasked, global_state, code)
    on_server = time.perf_counter() - began - on_devices
    peak = tracemalloc.get_traced_memory()[1] if trace_memory else 0
    if trace_memory:
        tracemalloc.stop()
    integers = [{n: t for n, t in s.items() if not torch.is_floating_point(t)} for s in states.values()]
    upload = {c: sum(len(v) for v in masked[c].values()) for c in masked}
    shares = {c: sum(len(b) for b in boxes.values()) for c, boxes in sealed.items()}
    seconds = {"devices": on_devices, "server": on_server}
    return SecureRound(
        SegmentSums(released, [i for i in integers if i]), withheld, clipped, upload, shares, seconds, peak
    )


def masked_clip(dp: DpSettings | None) -> float | None:
    """Under central DP, the L2 bound every device clips its parameters' change to before masking; else None."""
    return dp.clip if dp is not None and dp.mode == "central" else None


def dp_input(
    base: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], params: Collection[str], clip: float
) -> dict[str, torch.Tensor]:
    """What a device masks under central DP (feast_edge.privacy.mechanism): its parameters' change clipped to L2 norm
    ``clip``, every other tensor (BN statistics, counters) back at ``base``: the sum's sensitivity stays ``clip``."""
    return private_update(base, state, params, clip)[0]


def plain_values(updates: Sequence[tuple[str, Mapping[str, torch.Tensor], float]]) -> dict[str, int]:
    """Each device's plain sparse upload in values (its routed floating tensors): what secure sums are measured by."""
    return {c: sum(t.numel() for t in s.values() if torch.is_floating_point(t)) for c, s, _ in updates}
