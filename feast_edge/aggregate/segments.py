"""Method §6 from per-segment sums: what a collector that never hands over single updates delivers.

Routing is public (a device's budget decides its slices, not its data), so the positions of a round split into
*segments*: the positions routed to exactly the same set of cohort devices. Within a segment every position has the
same members, so §6's denominator is one number per segment and its numerator one sum per position::

    S_s[u] = Σ_{i ∈ s} n_i θ'_i[u]      W_s = Σ_{i ∈ s} n_i      θ_{t+1}[u] = S_s[u] / W_s   (u in segment s)

and positions outside every segment keep θ_t[u]. A collector may deliver these sums instead of the updates
(secure aggregation computes exactly them without revealing any θ'_i); :func:`plain_sums` computes them in the
clear, the reference such a collector must equal. Integer buffers are not summed: they travel as they are and take
their maximum, as in :func:`feast_edge.aggregate.sparse.aggregate`.

A segment is a list of *cells*, boxes of leading-slice coordinates: when the routed boxes of a tensor nest (FEAST's
envelopes do, method §5.3) a segment is the shell between two consecutive boxes, at most one cell per dimension;
otherwise the cells are those of the grid of distinct box edges.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from feast_edge.aggregate.checks import StateDict
from feast_edge.aggregate.sparse import aggregate

Box = tuple[int, ...]  # the stop of a leading slice along each dimension
Cell = tuple[tuple[int, int], ...]  # [start, stop) along each dimension


@dataclass(frozen=True)
class Segment:
    """The positions routed to exactly ``members`` (sorted), as cells per floating tensor."""

    members: tuple[str, ...]
    cells: dict[str, list[Cell]] = field(hash=False)


@dataclass
class SegmentSum:
    """One segment's sums: S_s per cell (in the order of the segment's cells) and W_s."""

    segment: Segment
    weight: float  # W_s, the members' summed sample weights
    values: dict[str, list[torch.Tensor]]  # tensor name -> S_s of each cell


@dataclass
class SegmentSums:
    """A round's input as sums: every segment's, and the integer buffers each contributor sent as they are."""

    sums: list[SegmentSum]
    integers: list[StateDict] = field(default_factory=list)

    @property
    def contributors(self) -> list[str]:
        return sorted({member for s in self.sums for member in s.segment.members})


def _index(cell: Cell) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in cell)


def _nested(boxes: Sequence[Box]) -> bool:
    """Each box inside the one before (boxes sorted largest first)."""
    return all(all(i <= o for i, o in zip(inner, outer)) for outer, inner in zip(boxes, boxes[1:]))


def _shell(outer: Box, inner: Box) -> list[Cell]:
    """``outer`` less ``inner`` (inside it), as at most one box per dimension."""
    cells = [
        tuple((0, inner[k]) for k in range(d)) + ((inner[d], outer[d]),) + tuple((0, o) for o in outer[d + 1 :])
        for d in range(len(outer))
    ]
    return [cell for cell in cells if all(a < b for a, b in cell)]


def _tensor_cells(boxes: Mapping[str, Box]) -> dict[tuple[str, ...], list[Cell]]:
    """One tensor's positions by the members routed them: members -> cells."""
    distinct = sorted(set(boxes.values()), key=lambda b: -torch.Size(b).numel())
    members = {
        box: tuple(sorted(c for c, b in boxes.items() if all(x <= y for x, y in zip(box, b)))) for box in distinct
    }
    if distinct == [()]:  # a scalar: one position, routed to every client that holds it
        return {members[()]: [()]}
    if _nested(distinct):
        found: dict[tuple[str, ...], list[Cell]] = {}
        for outer, inner in zip(distinct, [*distinct[1:], tuple(0 for _ in distinct[0])]):
            found.setdefault(members[outer], []).extend(_shell(outer, inner))
        return {m: cells for m, cells in found.items() if cells}
    edges = [sorted({0, *(b[d] for b in distinct)}) for d in range(len(distinct[0]))]
    found = {}
    for cell in itertools.product(*[list(zip(e, e[1:])) for e in edges]):
        inside = tuple(sorted(c for c, b in boxes.items() if all(stop <= b[d] for d, (_, stop) in enumerate(cell))))
        if inside:
            found.setdefault(inside, []).append(cell)
    return found


def segments_of(global_state: StateDict, routed: Mapping[str, Mapping[str, Box]]) -> list[Segment]:
    """The segments of a round whose clients were routed ``routed`` (client -> tensor name -> box), over the floating
    tensors of ``global_state``; by members, sorted."""
    return segments_over([name for name, t in global_state.items() if torch.is_floating_point(t)], routed)


def segments_over(names: Iterable[str], routed: Mapping[str, Mapping[str, Box]]) -> list[Segment]:
    """The segments over the floating tensors ``names`` (in sorted order: a device that holds only some of them finds
    the same cells, in the same order, for every segment it is a member of); by members, sorted."""
    cells: dict[tuple[str, ...], dict[str, list[Cell]]] = {}
    for name in sorted(names):
        boxes = {c: tuple(b[name]) for c, b in routed.items() if name in b and all(b[name])}
        if not boxes:
            continue
        for members, found in _tensor_cells(boxes).items():
            cells.setdefault(members, {})[name] = found
    return [Segment(members, cells[members]) for members in sorted(cells)]


def segment_id(members: Sequence[str]) -> str:
    """A segment's name, the same for every party that knows its members (16 hex characters)."""
    return hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:16]


def segment_values(segment: Segment) -> int:
    """The positions of ``segment`` (its cells' sizes, summed)."""
    return sum(_size(cell) for cells in segment.cells.values() for cell in cells)


def _size(cell: Cell) -> int:
    size = 1
    for a, b in cell:
        size *= b - a
    return size


def plain_sums(global_state: StateDict, updates: Iterable[tuple[str, StateDict, float]]) -> SegmentSums:
    """The segments' sums of ``updates`` (client, routed state, n_i), computed in the clear: what a collector that
    delivers sums must return for the same inputs."""
    updates = list(updates)
    states = {client: state for client, state, _ in updates}
    weights = {client: float(n) for client, _, n in updates}
    routed = {c: {name: tuple(t.shape) for name, t in s.items()} for c, s in states.items()}
    sums = []
    for segment in segments_of(global_state, routed):
        values = {
            name: [
                torch.stack([weights[m] * states[m][name][_index(cell)].double() for m in segment.members]).sum(0)
                for cell in cells
            ]
            for name, cells in segment.cells.items()
        }
        sums.append(SegmentSum(segment, sum(weights[m] for m in segment.members), values))
    integers = [{n: t for n, t in s.items() if not torch.is_floating_point(t)} for s in states.values()]
    return SegmentSums(sums, [i for i in integers if i])


def apply_sums(global_state: StateDict, sums: SegmentSums) -> None:
    """θ_{t+1} in place: S_s / W_s on every cell of every segment (the rest keeps θ_t), integer buffers their
    maximum over the contributors that sent them."""
    for s in sums.sums:
        if not s.weight > 0:
            raise ValueError(f"segment of {', '.join(s.segment.members)} has weight {s.weight}; weights must be > 0")
        for name, cells in s.segment.cells.items():
            target = global_state[name]
            for cell, value in zip(cells, s.values[name]):
                target[_index(cell)] = (value / s.weight).to(target.dtype)
    if sums.integers:
        aggregate(global_state, [(state, 1.0) for state in sums.integers], inplace=True)
