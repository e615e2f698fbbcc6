"""Robust aggregation over the clients covering each position: norm clipping, trimmed mean, median (issue 9).

method §6 averages every global position over the cohort clients whose routed
leading slice contains it. One client that sends a huge update moves that
average as far as it likes; the rules here bound its influence and keep the
sparse structure (a position only hears from the clients that were routed it;
a position nobody routed keeps the global value)::

    mean          θ[u] = Σ n_i θ'_i[u] / Σ n_i                  (method §6: exactly ``aggregate``)
    clip          θ'_i ← θ_i + Δ_i · min(1, c / ‖Δ_i‖₂), then mean   (Sun et al. 2019, "Can you really backdoor FL?")
    trimmed-mean  per position: drop the ⌊β·k⌋ lowest and highest of the k covering values, average the rest (Yin et al. 2018)
    median        per position: the median of the k covering values (the mean of the two middle ones when k is even)

``Δ_i`` is client i's update: its payload minus the leading slice of the
global state it was routed, over every floating tensor it sent (weights and BN
statistics), its norm summed in float64. With ``clip_norm=None`` the bound
``c`` is adaptive: the median of the cohort's (finite) update norms (the mean
of the two middle ones for an even cohort), so at most half the cohort is
scaled down and an honest majority sets the scale. An update with a non-finite
norm has no direction to keep and is scaled to nothing.

The coordinate-wise rules (``trimmed-mean``, ``median``) are *unweighted*, as
in Yin et al.: the sample counts are validated but do not weigh the values,
since a client could lie about them. Trimming needs enough clients on a
position: with β = 0.1 nothing is trimmed where fewer than 10 clients cover it
(``⌊0.1·k⌋ = 0``), and there the rule is the unweighted mean; in general
``⌊β·k⌋ = 0`` for ``k < 1/β``. β lies in [0, 0.5), so at least one value is
always kept. The median is the trimmed mean that drops ``⌊(k−1)/2⌋`` values at
each end, which keeps the middle value (odd k) or the two middle ones (even
k); with one or two clients on a position it is their mean.

Integer buffers (``num_batches_tracked``) take the element-wise maximum of the
clients that sent them under every rule, exactly as :func:`aggregate` does.

Implementation: for each floating tensor the payloads that sent it are stacked
into a ``(K, *box)`` buffer (``box`` the largest routed extent), +inf where a
client's slice does not reach, with a per-position count ``k`` of the clients
that do; sorting along the client axis puts the ``k`` covering values of every
position first. Memory is O(K × tensor) for one tensor at a time. Large
tensors of a cohort of at most 32 are sorted by a compare-exchange network
(Batcher's odd-even merge sort, element-wise ``minimum``/``maximum`` over whole
rows, several times faster than ``torch.sort`` along a short axis); others by
``torch.sort``. Where nothing is dropped at any ``k`` the rule is the mean and
no stack is built. A NaN a client sends counts as that client not covering the
position: the robust rules ignore it rather than let one broken client poison
the result.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from feast_edge.aggregate.sparse import aggregate, check_payload, check_samples
from feast_edge.util.slicing import leading_index, leading_slice

StateDict = Mapping[str, torch.Tensor]
RULES = ("mean", "clip", "trimmed-mean", "median")
# Sorting K values per position: a compare-exchange network of whole-row minimum/maximum beats torch.sort along
# a short axis for large tensors and small cohorts; on small tensors its Python loop costs more than it saves.
NETWORK_MAX_CLIENTS = 32
NETWORK_MIN_POSITIONS = 1 << 14


def rule_settings(rule: str, trim: float, clip_norm: float | None) -> dict[str, Any]:
    """The aggregation settings ``rule`` reads, for a run's fingerprint: none for the mean, so runs from before the
    robust rules existed keep their fingerprint."""
    used = {
        "mean": (),
        "clip": ("aggregation", "clip_norm"),
        "trimmed-mean": ("aggregation", "trim"),
        "median": ("aggregation",),
    }
    values = {"aggregation": rule, "trim": trim, "clip_norm": clip_norm}
    return {name: values[name] for name in used[rule]}


def check_rule(rule: str, trim: float = 0.1, clip_norm: float | None = None) -> None:
    """Raise :class:`ValueError` unless ``rule``, ``trim`` and ``clip_norm`` name a valid aggregation."""
    if rule not in RULES:
        raise ValueError(f"aggregation rule {rule!r} is unknown; choose one of {', '.join(RULES)} (--aggregation)")
    if not (isinstance(trim, (int, float)) and 0 <= trim < 0.5):
        raise ValueError(
            f"trim fraction {trim!r} must be in [0, 0.5): the share of values dropped at each end of a position (--trim)"
        )
    if clip_norm is not None and not (
        isinstance(clip_norm, (int, float)) and math.isfinite(clip_norm) and clip_norm > 0
    ):
        raise ValueError(
            f"clip norm {clip_norm!r} must be a positive finite L2 bound; leave it unset for the cohort's median update norm (--clip-norm)"
        )


def update_norm(local_state: StateDict, global_state: StateDict) -> float:
    """L2 norm of a payload's change to its routed leading slices, over its floating tensors, summed in float64."""
    total = 0.0
    for name, local in local_state.items():
        if local.is_floating_point():
            glob = leading_slice(global_state[name].detach(), local.shape)
            total += float((local.detach().double() - glob.double()).square().sum())
    return math.sqrt(total)


def clip_updates(
    global_state: StateDict,
    results: Iterable[tuple[StateDict, float]],
    clip_norm: float | None = None,
) -> list[tuple[StateDict, float]]:
    """Payloads whose update norm exceeds the bound, scaled back to it (``θ + Δ·c/‖Δ‖``); the others unchanged.

    ``clip_norm=None``: the bound is the median of the payloads' finite update
    norms (adaptive). A payload within the bound is returned as the same object, so
    clipping that scales nothing aggregates bit-identically to the mean.
    """
    results = list(results)
    norms = [update_norm(state, global_state) for state, _ in results]
    finite = [norm for norm in norms if math.isfinite(norm)]
    bound = clip_norm if clip_norm is not None else (float(np.median(finite)) if finite else 0.0)
    clipped = []
    for (state, n), norm in zip(results, norms):
        if norm <= bound:
            clipped.append((state, n))
            continue
        # A non-finite update has no direction to keep: it is scaled to nothing (the client sends back its routed slice).
        scale = bound / norm if math.isfinite(norm) else 0.0
        with torch.no_grad():
            scaled = {
                name: _toward(leading_slice(global_state[name].detach(), x.shape), x, scale)
                if x.is_floating_point()
                else x
                for name, x in state.items()
            }
        clipped.append((scaled, n))
    return clipped


def _toward(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """``start + weight·(end − start)`` in ``end``'s dtype; a copy of ``start`` when ``weight`` is 0 (``end`` may be non-finite)."""
    start = start.to(end.dtype)
    return start.clone() if weight == 0 else torch.lerp(start, end, weight)


def robust_aggregate(
    global_state: StateDict,
    results: Iterable[tuple[StateDict, float]],
    rule: str = "mean",
    *,
    trim: float = 0.1,
    clip_norm: float | None = None,
    dtype: torch.dtype = torch.float32,
    inplace: bool = False,
) -> dict[str, torch.Tensor]:
    """Aggregate ``(local_state, n_samples)`` payloads with ``rule`` (one of :data:`RULES`; see the module docstring).

    ``"mean"`` *is* :func:`aggregate` (same call, same bits). Every payload is
    validated with :func:`check_samples` and :func:`check_payload` before
    anything is written, so a bad one raises :class:`PayloadError` and changes
    nothing. ``dtype`` is the working precision; ``inplace=True`` writes the
    new global state into ``global_state``'s own tensors and returns them.
    """
    check_rule(rule, trim, clip_norm)
    if rule == "mean":
        return aggregate(global_state, results, dtype, inplace)
    checked = []
    for local_state, n_samples in results:
        n = check_samples(n_samples)
        check_payload(global_state, local_state)
        checked.append((local_state, n))
    if rule == "clip":
        return aggregate(global_state, clip_updates(global_state, checked, clip_norm), dtype, inplace)
    return _coordinate_wise(global_state, checked, rule, trim, dtype, inplace)


def _coordinate_wise(
    global_state: StateDict,
    results: list[tuple[StateDict, float]],
    rule: str,
    trim: float,
    dtype: torch.dtype,
    inplace: bool,
) -> dict[str, torch.Tensor]:
    """``trimmed-mean`` or ``median`` of every floating tensor; integer buffers as :func:`aggregate` treats them."""
    counters = [name for name, glob in global_state.items() if not glob.is_floating_point()]
    counted = aggregate(
        {name: global_state[name] for name in counters},
        [({name: state[name] for name in counters if name in state}, n) for state, n in results],
        inplace=inplace,
    )
    out = {}
    with torch.no_grad():
        for name, glob in global_state.items():
            if name in counted:
                out[name] = counted[name]
                continue
            slices = [state[name] for state, _ in results if name in state and state[name].numel() > 0]
            target = glob if inplace else glob.detach().clone()
            if slices:
                box, values, count = _position_rule(slices, rule, trim, dtype, glob.device)
                inside = target[leading_index(box)]
                inside.copy_(
                    torch.where(count > 0, values, inside.to(dtype))
                )  # positions of the box nobody reached keep theirs
            out[name] = target
    return out


def _position_rule(
    slices: list[torch.Tensor], rule: str, trim: float, dtype: torch.dtype, device: torch.device
) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """The rule over the clients covering each position of the slices' bounding box: ``(box, values, k)``."""
    k_max = len(slices)
    box = tuple(map(max, *(tuple(x.shape) for x in slices))) if k_max > 1 else tuple(slices[0].shape)
    # Values dropped at each end of a position covered by k clients (as Python computes ⌊β·k⌋, for every k alike).
    drop = [max(0, (k - 1) // 2) if rule == "median" else math.floor(trim * k) for k in range(k_max + 1)]
    count = torch.zeros(box, dtype=torch.int64, device=device)
    if not any(drop):  # nothing is dropped at any k: the unweighted mean, in one pass without a stack
        total = torch.zeros(box, dtype=dtype, device=device)
        for x in slices:
            present = ~x.isnan()
            total[leading_index(x.shape)].add_(torch.where(present, x.to(dtype), 0))
            count[leading_index(x.shape)] += present
        return box, total / count, count
    stack = torch.full((k_max, *box), math.inf, dtype=dtype, device=device)
    for row, x in zip(stack, slices):
        present = ~x.isnan()
        row[leading_index(x.shape)] = torch.where(present, x.to(dtype), math.inf)
        count[leading_index(x.shape)] += present
    rows = stack.view(k_max, -1)
    _sort_rows(rows)  # the k covering values of each position now come first (+inf, from the gaps, last)
    k = count.view(-1)
    low = torch.tensor(drop, device=device)[k]
    high = k - low  # keep ranks low <= r < high
    total = torch.zeros_like(rows[0])
    for r, row in enumerate(rows):
        total.add_(torch.where((low <= r) & (r < high), row, 0))
    return box, (total / (high - low)).view(box), count


def _sort_rows(rows: torch.Tensor) -> None:
    """Sort a ``(K, M)`` tensor along its first axis in place (no NaN)."""
    k, m = rows.shape
    if k > NETWORK_MAX_CLIENTS or m < NETWORK_MIN_POSITIONS:
        rows.copy_(rows.sort(dim=0).values)
        return
    low = torch.empty_like(rows[0])
    for a, b in _comparators(k):
        torch.minimum(rows[a], rows[b], out=low)
        torch.maximum(rows[a], rows[b], out=rows[b])
        rows[a].copy_(low)


@functools.cache
def _comparators(n: int) -> tuple[tuple[int, int], ...]:
    """Compare-exchange pairs ``(a, b)``, ``a < b``, of Batcher's odd-even merge sort of ``n`` values (Batcher 1968).

    Pairs that reach past ``n`` are dropped: the network for the next power of
    two with +inf in the missing inputs, which never move.
    """
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def aggregate_updates(
    global_state: Mapping[str, torch.Tensor],
    updates: Sequence[tuple[str, Mapping[str, torch.Tensor], int]],
    inplace: bool = False,
    *,
    rule: str = "mean",
    trim: float = 0.1,
    clip_norm: float | None = None,
) -> dict[str, torch.Tensor]:
    """Aggregation of ``(client_id, state, n_samples)`` in client-id order: method §6's sparse sample-weighted mean by default.

    ``rule``, ``trim`` and ``clip_norm`` choose a robust rule instead
    (:mod:`feast_edge.aggregate.robust`). ``inplace=True`` writes the result into
    ``global_state``'s tensors (pass a model's ``state_dict()`` to update the
    model without a copy).
    """
    ordered = sorted(updates, key=lambda u: u[0])
    return robust_aggregate(
        global_state, [(state, n) for _, state, n in ordered], rule, trim=trim, clip_norm=clip_norm, inplace=inplace
    )
