"""The accumulator behind sparse aggregation (method §6): a running weighted mean while boxes nest, sums otherwise.

:func:`feast_edge.aggregate.sparse.aggregate` states the formula; this module
computes it fast. Payloads are folded in one at a time (a payload is validated
in full first, so a rejected one changes nothing; the global state is written
only with ``inplace=True``, and :func:`~feast_edge.aggregate.sparse.aggregate`
validates every payload before writing anything). FEAST's envelopes are
nested, so taken largest first every payload's box of a tensor lies inside the
previous one and all of its positions share one running count ``C``; the
accumulator then holds the running weighted *mean* and folds the payload in
with a single ``lerp_`` (``μ ← μ + n/(C+n)·(θ' − μ)``), touching only the
payload's own positions, with no zero-fill and no final division.
:func:`~feast_edge.aggregate.sparse.aggregate` sorts payloads largest first for
this reason. A box that sticks out of its predecessor (arbitrary leading
slices, or payloads streamed smallest first) switches that tensor to explicit
value and count accumulators: ``Σ n_i θ'_i`` per position, and ``Σ n_i`` kept
as the list of ``(box_i, n_i)`` terms, expanded once at the end on the grid of
distinct box edges. Both forms compute the formula of method §6; float32 by
default (as FedAvg over float32 models), ``torch.float64`` for an exact
reference. :meth:`SparseAccumulator.result` finishes in place in the
accumulator buffers and fills positions outside every routed box from the
global state. Integer buffers hold the element-wise maximum in both forms.
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import torch

from feast_edge.aggregate.checks import StateDict, check_payload, check_samples
from feast_edge.util.slicing import leading_index


def _lowest(dtype: torch.dtype) -> int | bool:
    return False if dtype == torch.bool else torch.iinfo(dtype).min


class _BoxCounts:
    """Count accumulator ``Σ n_i·[u inside box_i]`` of one tensor, kept as its ``(box_i, n_i)`` terms.

    The count is constant between consecutive box edges, so :meth:`over` sums
    the terms on the small grid of distinct edges and expands that grid to
    positions once, instead of touching every routed position on every add.
    """

    def __init__(self) -> None:
        self.terms: list[tuple[tuple[int, ...], float]] = []
        self.box: tuple[int, ...] = ()  # per-dim maximum routed extent

    def add(self, box: tuple[int, ...], n: float) -> None:
        """Add ``n`` to every position of the leading ``box``."""
        if not self.terms:
            self.box = box
        elif box != self.box:
            self.box = tuple(map(max, self.box, box))
        self.terms.append((box, n))

    def over(self, box: tuple[int, ...], dtype: np.dtype = np.float64) -> np.ndarray:
        """Counts of the positions of the leading ``box``; size 1 along dims where they are constant."""
        edges = [sorted({min(b[d], m) for b, _ in self.terms} | {m}) for d, m in enumerate(box)]
        cells = np.zeros([len(e) for e in edges])
        for b, n in self.terms:
            cells[tuple(slice(0, e.index(min(x, m)) + 1) for x, m, e in zip(b, box, edges))] += n
        cells = cells.astype(dtype)
        for d, e in enumerate(edges):
            if len(e) > 1:
                cells = np.repeat(cells, np.diff([0, *e]), axis=d)
        return cells


class _Slot:
    """Accumulator of one tensor: its buffer at the global shape, the count terms, and which form the buffer holds.

    ``mean`` form (while every new box lies inside the previous one): the
    buffer holds the running sample-weighted *mean* over the bounding box.
    ``sum`` form (once a box sticks out of its predecessor): the buffer holds
    ``Σ n_i θ'_i`` and the count grid divides it at the end.
    """

    __slots__ = ("values", "floating", "aliased", "full", "counts", "last", "total", "mean")

    def __init__(self, values: torch.Tensor, floating: bool, box: tuple[int, ...], n: float, aliased: bool) -> None:
        self.values = values
        self.floating = floating
        self.aliased = aliased  # ``values`` is the global tensor itself (in-place aggregation)
        self.full = tuple(values.shape)
        self.counts = _BoxCounts()
        self.counts.add(box, n)
        self.last = box  # the most recent box (the smallest, in mean form)
        self.total = n  # Σ n_i, the count of every position of ``last`` in mean form
        self.mean = True

    def fast(self, local: torch.Tensor, box: tuple[int, ...]) -> bool:
        """Whether ``local`` folds in with one same-dtype ``lerp_``: mean form, floating, box inside the last one."""
        return (
            self.mean
            and self.floating
            and local.dtype == self.values.dtype
            and local.device == self.values.device
            and _inside(box, self.last)
        )

    def note(self, box: tuple[int, ...], n: float) -> None:
        """Record that ``n`` samples' worth of payload covered ``box``."""
        self.counts.add(box, n)
        self.last = box
        self.total += n


class SparseAccumulator:
    """Value and count accumulators over one global state dict; ``add`` payloads, then ``result`` (method §6).

    Each tensor keeps a running mean while its boxes stay nested (largest
    first) and switches to explicit sums and counts otherwise; see the module
    docstring.

    ``inplace=False`` (default): the global state is never written and
    :meth:`result` returns new tensors. ``inplace=True``: the global tensors
    *are* the accumulator buffers wherever their dtype allows, so a round
    allocates (almost) nothing, positions nobody routed are not even read, and
    :meth:`result` returns the global tensors themselves, updated. They hold
    partial averages until then, and a payload rejected by :meth:`add` leaves
    the earlier ones applied; :func:`~feast_edge.aggregate.sparse.aggregate`
    validates every payload before writing anything.
    """

    def __init__(self, global_state: StateDict, dtype: torch.dtype = torch.float32, inplace: bool = False) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"accumulator dtype {dtype} must be torch.float32 or torch.float64")
        self._global = dict(global_state)  # references; written only when ``inplace``
        self._inplace = inplace
        self._dtype = dtype
        self._slots: dict[str, _Slot] = {}
        self._scratch = torch.empty(0, dtype=dtype)  # dtype conversion buffer (mixed-dtype ops are slow)
        self._result: dict[str, torch.Tensor] | None = None
        self.clients = 0
        self.total_samples = 0.0

    def add(self, local_state: StateDict, n_samples: float) -> None:
        """Accumulate one client's returned leading slices with weight ``n_samples``."""
        if self._result is not None:
            raise RuntimeError("this accumulator has already produced its result; start a new one for the next round")
        n = check_samples(n_samples)
        check_payload(self._global, local_state)
        self._accumulate(local_state, n)

    def _accumulate(self, local_state: StateDict, n: float) -> None:
        """:meth:`add` after validation (payload by payload)."""
        with torch.no_grad():
            for name, local in local_state.items():
                box = tuple(local.shape)
                if 0 not in box:
                    self._fold_one(name, local, box, n)
        self.clients += 1
        self.total_samples += n

    def add_validated(self, payloads: list[tuple[StateDict, float]]) -> None:
        """All of a cohort's payloads, tensor by tensor, in the given order; each already passed :meth:`add`'s checks.

        Same arithmetic as :meth:`add` payload by payload, except that the first
        two payloads of a nested tensor are fused: ``lerp(θ'_1, θ'_2, w)`` is
        written straight into the buffer instead of a copy followed by ``lerp_``.
        """
        with torch.no_grad():
            for name in self._global:
                items = [(p[name], tuple(p[name].shape), n) for p, n in payloads if name in p]
                items = [item for item in items if 0 not in item[1]]
                start = 2 if len(items) > 1 and self._open_two(name, items[0], items[1]) else 0
                for local, box, n in items[start:]:
                    self._fold_one(name, local, box, n)
        self.clients += len(payloads)
        self.total_samples += sum(n for _, n in payloads)

    def _fold_one(self, name: str, local: torch.Tensor, box: tuple[int, ...], n: float) -> None:
        slot = self._slots.get(name)
        if slot is None:
            self._slots[name] = self._open(self._global[name], local, box, n)
        elif slot.fast(local, box):  # the common case, inlined: a nested box of a floating tensor
            view = slot.values if box == slot.full else slot.values[_index(box)]
            view.lerp_(local, n / (slot.total + n))
            slot.note(box, n)
        else:
            self._fold(slot, self._global[name], local, box, n)

    def _open_two(self, name: str, first: tuple, second: tuple) -> bool:
        """Open a floating tensor from its first two payloads at once when the second's box is inside the first's."""
        (x1, b1, n1), (x2, b2, n2) = first, second
        glob = self._global[name]
        dtype, device = self._dtype, glob.device
        if not (glob.is_floating_point() and x1.dtype == x2.dtype == dtype and x1.device == x2.device == device):
            return False
        if not _inside(b2, b1):
            return False
        aliased = self._inplace and glob.dtype == dtype
        values = glob.detach() if aliased else torch.empty(glob.shape, dtype=dtype, device=device)
        inner = _index(b2)
        torch.lerp(x1[inner], x2, n2 / (n1 + n2), out=values[inner])
        for slab in _outside(b2, b1):  # the first payload's positions outside the second's box
            values[slab] = x1[slab]
        slot = self._slots[name] = _Slot(values, True, b1, n1, aliased)
        slot.note(b2, n2)
        return True

    def _open(self, glob: torch.Tensor, local: torch.Tensor, box: tuple[int, ...], n: float) -> _Slot:
        """First payload of a tensor: its values are the mean so far (only the box is written)."""
        dtype = self._dtype if glob.is_floating_point() else glob.dtype
        aliased = self._inplace and glob.dtype == dtype
        values = glob.detach() if aliased else torch.empty(glob.shape, dtype=dtype, device=glob.device)
        values[_index(box)].copy_(local)
        return _Slot(values, glob.is_floating_point(), box, n, aliased)

    def _fold(self, slot: _Slot, glob: torch.Tensor, local: torch.Tensor, box: tuple[int, ...], n: float) -> None:
        """Any other payload: dtype conversion, integer maximum, or a box that leaves the nested chain."""
        if slot.mean and not _inside(box, slot.last):
            self._to_sums(slot, glob, box)
        elif not slot.mean:
            self._grow(slot, glob, box)
        view = slot.values[_index(box)]
        local = self._as(local, slot.values)
        if not slot.floating:
            torch.maximum(view, local, out=view)
        elif slot.mean:
            view.lerp_(local, n / (slot.total + n))
        else:
            view.add_(local, alpha=n)
        slot.note(box, n)

    def _to_sums(self, slot: _Slot, glob: torch.Tensor, box: tuple[int, ...]) -> None:
        """Switch a tensor from running mean to explicit sums (a box that is not inside its predecessor)."""
        slot.mean = False
        if slot.aliased:  # growing would overwrite global values that may stay unrouted: use a buffer of its own
            own = torch.empty_like(slot.values)
            bbox = _index(slot.counts.box)
            own[bbox].copy_(slot.values[bbox])
            slot.values, slot.aliased = own, False
        if glob.is_floating_point():  # integer buffers hold a maximum in both forms
            inside = slot.values[_index(slot.counts.box)]
            count = slot.counts.over(slot.counts.box, np.float64 if self._dtype == torch.float64 else np.float32)
            inside.mul_(torch.as_tensor(count, device=inside.device))
        self._grow(slot, glob, box)

    @staticmethod
    def _grow(slot: _Slot, glob: torch.Tensor, box: tuple[int, ...]) -> None:
        """Extend the initialised region (the bounding box) to cover ``box``: new positions start at sum 0 / max lowest."""
        old = slot.counts.box
        new = tuple(map(max, old, box))
        if new == old:
            return
        start = 0 if glob.is_floating_point() else _lowest(glob.dtype)
        for slab in _outside(old, new):
            slot.values[slab] = start

    def _as(self, local: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """``local`` on ``acc``'s device and dtype, converted through a reused scratch buffer."""
        if local.dtype == acc.dtype and local.device == acc.device:
            return local
        if (
            self._scratch.numel() < local.numel()
            or self._scratch.dtype != acc.dtype
            or self._scratch.device != acc.device
        ):
            self._scratch = torch.empty(max(local.numel(), self._scratch.numel()), dtype=acc.dtype, device=acc.device)
        return self._scratch[: local.numel()].view(local.shape).copy_(local)

    def count(self, name: str) -> torch.Tensor:
        """Per-position ``Σ n_i`` of tensor ``name`` at its global shape (zeros if nobody routed it)."""
        glob = self._global[name]
        slot = self._slots.get(name)
        if slot is None:
            return torch.zeros(glob.shape, dtype=torch.float64)
        return torch.from_numpy(slot.counts.over(tuple(glob.shape))).expand(glob.shape)

    def result(self) -> dict[str, torch.Tensor]:
        """New global state: routed positions get value/count, the rest keep the global value.

        The first call finalizes the accumulator (its buffers become the returned
        tensors, so no extra copy is made); later calls return the same state.
        """
        if self._result is None:
            grids: dict[tuple, np.ndarray] = {}  # tensors routed alike (a BN's four vectors) share one count grid
            with torch.no_grad():
                self._result = {name: self._finish(name, glob, grids) for name, glob in self._global.items()}
            self._slots.clear()
        return self._result

    def _finish(self, name: str, glob: torch.Tensor, grids: dict[tuple, np.ndarray]) -> torch.Tensor:
        slot = self._slots.get(name)
        if slot is None:  # nobody routed it
            return glob if self._inplace else glob.detach().clone()
        values = slot.values
        if self._inplace:
            out = glob
        else:  # finish in the accumulator when the dtypes agree: it becomes the new tensor
            out = values if values.dtype == glob.dtype else torch.empty_like(glob.detach())
        glob = glob.detach()
        box = slot.counts.box
        idx = _index(box)
        inside, target = values[idx], out[idx]
        if slot.mean:  # every position of the bounding box was routed and already holds its mean
            if not slot.aliased and out is not values:
                target.copy_(inside)
            return out if self._inplace else self._fill_outside(out, glob, box)
        key = (box, tuple(slot.counts.terms))
        if key not in grids:
            grids[key] = slot.counts.over(box, np.float64 if self._dtype == torch.float64 else np.float32)
        count = torch.as_tensor(grids[key], device=glob.device)
        positive = count > 0
        if not glob.is_floating_point():
            target.copy_(torch.where(positive, inside, glob[idx]))
        elif bool(positive.all()):  # nested boxes that arrived out of order: every position was routed
            torch.div(inside, count, out=target)
        else:
            mean = inside / count  # 0/0 where unrouted, masked next
            target.copy_(torch.where(positive, mean, glob[idx]))
        return out if self._inplace else self._fill_outside(out, glob, box)

    @staticmethod
    def _fill_outside(out: torch.Tensor, glob: torch.Tensor, box: tuple[int, ...]) -> torch.Tensor:
        """Positions outside the routed bounding box keep the global value."""
        for slab in _outside(box, tuple(glob.shape)):
            out[slab] = glob[slab]
        return out


def _inside(box: tuple[int, ...], outer: tuple[int, ...]) -> bool:
    """Whether the leading ``box`` lies inside the leading ``outer`` box."""
    return box == outer or all(map(operator.le, box, outer))


@functools.lru_cache(maxsize=4096)
def _index(box: tuple[int, ...]) -> tuple[slice, ...]:
    """:func:`leading_index` of a box, memoized (aggregation indexes the same few hundred boxes every round)."""
    return leading_index(box)


def _outside(box: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Disjoint slabs covering every position of the leading ``shape`` outside the leading ``box`` (valid in any tensor at least ``shape``)."""
    slabs = []
    for d, (b, n) in enumerate(zip(box, shape)):
        if b < n:
            slabs.append(leading_index(box[:d]) + (slice(b, n),) + leading_index(shape[d + 1 :]))
    return slabs
