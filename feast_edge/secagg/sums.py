"""A round's per-segment sums through secure aggregation (feast_edge.secagg.protocol), in process: what
``feast-edge simulate --secure-agg`` releases, and what the plain sums (feast_edge.aggregate.segments.plain_sums)
are compared with.

Each device encodes, per segment it is routed, its weighted change w · (θ' - θ_t) on the segment's cells and its
weight w = n / n_max (the cohort's largest count is public: the registry), clipped to ±``bound`` per value, in 32-bit
fixed point; the weight rides as the last value, so W = Σ w is summed securely too. The server unmasks
S = Σ w(θ' - θ_t) and W, and releases θ_t + S / W on the segment (as S_s / W_s over n_i θ'_i: the same mean).
A segment masked by fewer than c + 2 devices is withheld and keeps θ_t, with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from feast_edge.aggregate.checks import StateDict
from feast_edge.aggregate.segments import Segment, SegmentSum, SegmentSums, _index, segments_of
from feast_edge.secagg.fixed import FixedPoint
from feast_edge.secagg.protocol import Device, Setup, threshold_for, unmasked_sums

DEFAULT_BOUND = 8.0  # |w · (θ' - θ_t)| per value before encoding; a local training run's change stays far below


@dataclass
class SecureRound:
    """What a secure round released and withheld, and what it cost."""

    sums: SegmentSums
    withheld: dict[str, str] = field(default_factory=dict)  # members (comma-joined) -> why their segment kept θ_t
    clipped: int = 0  # values beyond ±bound, clipped before encoding
    upload_values: dict[str, int] = field(default_factory=dict)  # device -> 32-bit values it uploaded
    share_bytes: dict[str, int] = field(default_factory=dict)  # device -> sealed key shares it sent (key material)
    seconds: dict[str, float] = field(default_factory=dict)  # "devices" (all of them, in turn) and "server"


def _parts(segment: Segment) -> list[tuple[str, tuple]]:
    return [(name, cell) for name, cells in segment.cells.items() for cell in cells]


def secure_sums(
    global_state: StateDict,
    updates: Sequence[tuple[str, StateDict, float]],
    *,
    colluders: int = 1,
    bound: float = DEFAULT_BOUND,
    context: str = "simulation",
) -> SecureRound:
    """The per-segment sums of ``updates`` (client, routed state, n_i) as the server unmasks them (see the module
    docstring); every device of ``updates`` takes part in every stage."""
    states = {c: s for c, s, _ in updates}
    n_max = max(float(n) for _, _, n in updates)
    weights = {c: float(n) / n_max for c, _, n in updates}
    routed = {c: {name: tuple(t.shape) for name, t in s.items()} for c, s in states.items()}
    segments = {f"s{k}": seg for k, seg in enumerate(segments_of(global_state, routed))}
    code = FixedPoint.for_sum(len(states), bound)
    inputs: dict[str, dict[str, np.ndarray]] = {c: {} for c in states}
    lengths, clipped = {}, 0
    for sid, segment in segments.items():
        parts = _parts(segment)
        for c in segment.members:
            change = [
                (weights[c] * (states[c][n][_index(cell)].double() - global_state[n][_index(cell)].double()))
                .flatten()
                .numpy()
                for n, cell in parts
            ]
            values = np.concatenate([*change, [weights[c]]])
            clipped += int(np.count_nonzero(np.abs(values) > bound))
            inputs[c][sid] = code.encode(values)
            lengths[sid] = len(values)
    setup = Setup(
        context,
        {sid: (seg.members, lengths[sid]) for sid, seg in segments.items()},
        threshold_for(len(states), colluders),
        colluders + 2,
    )
    began = time.perf_counter()
    devices = {c: Device(c, setup, inputs[c]) for c in sorted(states)}
    roster = {c: d.advertise() for c, d in devices.items()}
    sealed = {c: d.share(roster) for c, d in devices.items()}
    for c, d in devices.items():
        d.receive({sender: boxes[c] for sender, boxes in sealed.items() if sender != c})
    shared = sorted(devices)
    masked = {c: d.mask(shared) for c, d in devices.items()}
    revealed = {c: d.unmask(sorted(masked)) for c, d in devices.items()}
    on_devices = time.perf_counter() - began
    unmasked = unmasked_sums(setup, roster, shared, masked, revealed)
    on_server = time.perf_counter() - began - on_devices
    released, withheld = [], {}
    for sid, segment in segments.items():
        result = unmasked[sid]
        if isinstance(result, str):
            withheld[", ".join(segment.members)] = result
            continue
        decoded = code.decode(result)
        weight, offset, values = float(decoded[-1]), 0, {}
        for n, cell in _parts(segment):
            base = global_state[n][_index(cell)].double()
            size = base.numel()
            change = torch.from_numpy(decoded[offset : offset + size].copy()).reshape(base.shape)
            values.setdefault(n, []).append(change + weight * base)  # S = Σ w θ' = Σ w (θ' - θ_t) + W θ_t
            offset += size
        released.append(SegmentSum(segment, weight, values))
    integers = [{n: t for n, t in s.items() if not torch.is_floating_point(t)} for s in states.values()]
    upload = {c: sum(len(v) for v in masked[c].values()) for c in masked}
    shares = {c: sum(len(b) for b in boxes.values()) for c, boxes in sealed.items()}
    seconds = {"devices": on_devices, "server": on_server}
    return SecureRound(SegmentSums(released, [i for i in integers if i]), withheld, clipped, upload, shares, seconds)


def plain_values(updates: Sequence[tuple[str, Mapping[str, torch.Tensor], float]]) -> dict[str, int]:
    """Each device's plain sparse upload in values (its routed floating tensors): what secure sums are measured by."""
    return {c: sum(t.numel() for t in s.values() if torch.is_floating_point(t)) for c, s, _ in updates}
