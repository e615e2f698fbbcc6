"""Sparse sample-weighted aggregation of routed payloads (SPEC §6).

Each returned local state dict holds, per tensor name, the *leading slice* of
the global tensor of the same name that the client was routed (SPEC §1, §5).
Every global position ``u`` becomes the sample-weighted mean over the cohort
clients whose payload contains it, and keeps its value when none does::

    θ_{t+1}[u] = Σ_{i: u∈U_i} n_i θ'_i[u] / Σ_{i: u∈U_i} n_i     (some client routed u)
    θ_{t+1}[u] = θ_t[u]                                           (otherwise)

Routing, not activation, decides membership: a routed position that no local
variant activated comes back unchanged and still enters the average. When every
client routes the full model this is exactly FedAvg.

Value accumulator: ``Σ n_i θ'_i`` per position, in ``float32`` by default (as
FedAvg over float32 models; pass ``torch.float64`` for an exact reference).
Count accumulator: ``Σ n_i`` per position; because every payload is a leading
box, it is kept as the list of ``(box_i, n_i)`` terms and expanded once, at
the end, on the grid of distinct box edges (constant dims stay broadcast), so
an ``add`` touches only the payload's own positions. A payload is validated in
full before any of it is accumulated, so a rejected one changes nothing; the
global state is never written. :meth:`SparseAccumulator.result` finishes in
place in the value buffers (positions with a count get value/count, all others
the global value) and returns them as the new global state.

Buffers:

* BatchNorm ``running_mean`` / ``running_var`` are floating tensors and are
  treated exactly like weights: sample-weighted over the clients that routed
  each channel. SPEC §8 recalibrates BN statistics before every evaluated
  operating point, so these averages only seed that recalibration.
* Integer buffers (``num_batches_tracked``) cannot be meaningfully averaged;
  they take the element-wise maximum over the clients that sent them, and keep
  the global value when no client did. Each client starts from the global
  counter, so the maximum never moves backwards.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Mapping

import numpy as np
import torch

from feast_edge.errors import FeastError
from feast_edge.slicing import leading_index

StateDict = Mapping[str, torch.Tensor]


class PayloadError(FeastError, ValueError):
    """A returned payload does not fit the global state (unknown name, not a leading slice, bad weight)."""


def check_payload(global_state: StateDict, local_state: StateDict) -> None:
    """Raise :class:`PayloadError` unless every local tensor is a leading slice of the same-named global one (SPEC §5)."""
    for name, local in local_state.items():
        if name not in global_state:
            raise PayloadError(
                f"payload tensor '{name}' does not exist in the global model; "
                "route clients from this global state dict (same preset and classes)"
            )
        if not isinstance(local, torch.Tensor):
            raise PayloadError(f"payload entry '{name}' is a {type(local).__name__}, not a tensor; send a state dict")
        glob = global_state[name]
        if local.dim() != glob.dim() or any(n > m for n, m in zip(local.shape, glob.shape)):
            raise PayloadError(
                f"payload tensor '{name}' has shape {tuple(local.shape)}, which is not a leading slice of the global "
                f"shape {tuple(glob.shape)}; route the client from this global model's envelope"
            )
        if local.is_floating_point() != glob.is_floating_point():
            raise PayloadError(
                f"payload tensor '{name}' has dtype {local.dtype} but the global tensor has {glob.dtype}; "
                "send floating tensors for weights and integer tensors for counters"
            )


def check_samples(n_samples: float) -> float:
    """Validated aggregation weight ``n_i`` (a positive, finite sample count)."""
    ok = isinstance(n_samples, numbers.Real) and not isinstance(n_samples, (bool, np.bool_)) and math.isfinite(n_samples)
    if not ok or n_samples <= 0:
        raise PayloadError(f"sample count {n_samples!r} must be a positive finite number (the client's shard size)")
    return float(n_samples)


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
        self.box = box if not self.terms else tuple(map(max, self.box, box))
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


class SparseAccumulator:
    """Value and count accumulators over one global state dict; ``add`` payloads, then ``result`` (SPEC §6)."""

    def __init__(self, global_state: StateDict, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"accumulator dtype {dtype} must be torch.float32 or torch.float64")
        self._global = dict(global_state)  # references only; never written
        self._dtype = dtype
        self._values: dict[str, torch.Tensor] = {}  # Σ n_i θ'_i (floating) or max θ'_i (integer), global shape
        self._counts: dict[str, _BoxCounts] = {}  # Σ n_i per position
        self._scratch = torch.empty(0, dtype=dtype)  # dtype conversion buffer (mixed-dtype add_ is slow)
        self._result: dict[str, torch.Tensor] | None = None
        self.clients = 0
        self.total_samples = 0.0

    def add(self, local_state: StateDict, n_samples: float) -> None:
        """Accumulate one client's returned leading slices with weight ``n_samples``."""
        if self._result is not None:
            raise RuntimeError("this accumulator has already produced its result; start a new one for the next round")
        n = check_samples(n_samples)
        check_payload(self._global, local_state)
        for name, local in local_state.items():
            if local.numel() == 0:
                continue
            glob = self._global[name]
            acc = self._accumulator(name, glob)
            view = acc[leading_index(local.shape)]
            local = self._as(local.detach(), acc)
            if glob.is_floating_point():
                view.add_(local, alpha=n)
            else:
                torch.maximum(view, local, out=view)
            self._route(name, tuple(local.shape), n)
        self.clients += 1
        self.total_samples += n

    def _accumulator(self, name: str, glob: torch.Tensor) -> torch.Tensor:
        acc = self._values.get(name)
        if acc is None:
            dtype = self._dtype if glob.is_floating_point() else glob.dtype
            start = 0 if glob.is_floating_point() else _lowest(glob.dtype)
            acc = self._values[name] = torch.full(glob.shape, start, dtype=dtype, device=glob.device)
        return acc

    def _as(self, local: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """``local`` on ``acc``'s device and dtype, converted through a reused scratch buffer."""
        if local.dtype == acc.dtype and local.device == acc.device:
            return local
        if self._scratch.numel() < local.numel() or self._scratch.dtype != acc.dtype or self._scratch.device != acc.device:
            self._scratch = torch.empty(max(local.numel(), self._scratch.numel()), dtype=acc.dtype, device=acc.device)
        return self._scratch[: local.numel()].view(local.shape).copy_(local)

    def _route(self, name: str, shape: tuple[int, ...], n: float) -> None:
        """Add ``n`` to the count of every position of the leading slice ``shape``."""
        counts = self._counts.get(name)
        if counts is None:
            counts = self._counts[name] = _BoxCounts()
        counts.add(shape, n)

    def count(self, name: str) -> torch.Tensor:
        """Per-position ``Σ n_i`` of tensor ``name`` at its global shape (zeros if nobody routed it)."""
        glob = self._global[name]
        counts = self._counts.get(name)
        if counts is None:
            return torch.zeros(glob.shape, dtype=torch.float64)
        return torch.from_numpy(counts.over(tuple(glob.shape))).expand(glob.shape)

    def result(self) -> dict[str, torch.Tensor]:
        """New global state: routed positions get value/count, the rest keep the global value.

        The first call finalizes the accumulator (its buffers become the returned
        tensors, so no extra copy is made); later calls return the same state.
        """
        if self._result is None:
            grids: dict[tuple, np.ndarray] = {}  # tensors routed alike (a BN's four vectors) share one count grid
            self._result = {name: self._finish(name, glob, grids) for name, glob in self._global.items()}
            self._values.clear()
        return self._result

    def _finish(self, name: str, glob: torch.Tensor, grids: dict[tuple, np.ndarray]) -> torch.Tensor:
        glob = glob.detach()
        counts = self._counts.get(name)
        if counts is None:
            return glob.clone()
        values = self._values[name]
        # Finish in place when the dtypes agree: the accumulator becomes the new tensor.
        out = values if values.dtype == glob.dtype else torch.empty_like(glob)
        box = counts.box
        idx = leading_index(box)
        key = (box, tuple(counts.terms))
        if key not in grids:
            grids[key] = counts.over(box, np.float64 if self._dtype == torch.float64 else np.float32)
        count = grids[key]
        positive = count > 0
        inside, target = values[idx], out[idx]
        if not glob.is_floating_point():
            target.copy_(torch.where(torch.as_tensor(positive, device=glob.device), inside, glob[idx]))
        elif positive.all():  # the nested-envelope case: every position of the box was routed
            torch.div(inside, torch.as_tensor(count, device=glob.device), out=target)
        else:
            mean = inside / torch.as_tensor(count, device=glob.device)  # 0/0 where unrouted, masked next
            target.copy_(torch.where(torch.as_tensor(positive, device=glob.device), mean, glob[idx]))
        return self._fill_outside(out, glob, box)

    @staticmethod
    def _fill_outside(out: torch.Tensor, glob: torch.Tensor, box: tuple[int, ...]) -> torch.Tensor:
        """Positions outside the routed bounding box keep the global value."""
        for slab in _outside(box, tuple(glob.shape)):
            out[slab] = glob[slab]
        return out


def _outside(box: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Disjoint slabs covering every position of ``shape`` outside the leading ``box``."""
    slabs = []
    for d, (b, n) in enumerate(zip(box, shape)):
        if b < n:
            slabs.append(leading_index(box[:d]) + (slice(b, n),) + (slice(None),) * (len(shape) - d - 1))
    return slabs


def aggregate(
    global_state: StateDict,
    results: Iterable[tuple[StateDict, float]],
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Sparse sample-weighted average of ``(local_state, n_samples)`` payloads into a new global state (SPEC §6)."""
    acc = SparseAccumulator(global_state, dtype)
    for local_state, n_samples in results:
        acc.add(local_state, n_samples)
    return acc.result()
