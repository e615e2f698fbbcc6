"""Robust aggregation over the clients covering each position: norm clipping, trimmed mean, median (issue 9).

SPEC §6 averages every global position over the cohort clients whose routed
leading slice contains it. One client that sends a huge update moves that
average as far as it likes; the rules here bound its influence and keep the
sparse structure (a position only hears from the clients that were routed it;
a position nobody routed keeps the global value)::

    mean          θ[u] = Σ n_i θ'_i[u] / Σ n_i                  (SPEC §6: exactly ``aggregate``)
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
always kept.

Integer buffers (``num_batches_tracked``) take the element-wise maximum of the
clients that sent them under every rule, exactly as :func:`aggregate` does.

Implementation: for each floating tensor the covering payloads are stacked
into a ``(K, *box)`` buffer (``box`` the largest routed extent), NaN where a
client's slice does not reach, and sorted along the client axis (NaN sorts
last), so the ``k`` covering values of every position come first; memory is
O(K × tensor) for one tensor at a time. A NaN a client itself sends counts as
that client not covering the position: the robust rules ignore it rather than
let one broken client poison the result.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from feast_edge.aggregate import aggregate, check_payload, check_samples
from feast_edge.slicing import leading_index, leading_slice

StateDict = Mapping[str, torch.Tensor]
RULES = ("mean", "clip", "trimmed-mean", "median")


def check_rule(rule: str, trim: float = 0.1, clip_norm: float | None = None) -> None:
    """Raise :class:`ValueError` unless ``rule``, ``trim`` and ``clip_norm`` name a valid aggregation."""
    if rule not in RULES:
        raise ValueError(f"aggregation rule {rule!r} is unknown; choose one of {', '.join(RULES)} (--aggregation)")
    if not (isinstance(trim, (int, float)) and 0 <= trim < 0.5):
        raise ValueError(f"trim fraction {trim!r} must be in [0, 0.5): the share of values dropped at each end of a position (--trim)")
    if clip_norm is not None and not (isinstance(clip_norm, (int, float)) and math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip norm {clip_norm!r} must be a positive finite L2 bound; leave it unset for the cohort's median update norm (--clip-norm)")


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
            scaled = {name: _toward(leading_slice(global_state[name].detach(), x.shape), x, scale) if x.is_floating_point() else x for name, x in state.items()}
        clipped.append((scaled, n))
    return clipped


def _toward(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """``start + weight·(end − start)`` in ``end``'s dtype; ``start`` itself when ``weight`` is 0 (``end`` may be non-finite)."""
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
                box, values = _position_rule(slices, rule, trim, dtype, glob.device)
                inside = target[leading_index(box)]
                covered = ~values.isnan()  # positions of the box that no client reached come back NaN
                inside.copy_(torch.where(covered, values, inside.to(dtype)))
            out[name] = target
    return out


def _position_rule(slices: list[torch.Tensor], rule: str, trim: float, dtype: torch.dtype, device: torch.device) -> tuple[tuple[int, ...], torch.Tensor]:
    """The rule over the clients covering each position of the slices' bounding box; NaN where none does."""
    k_max = len(slices)
    box = tuple(map(max, *(tuple(x.shape) for x in slices))) if k_max > 1 else tuple(slices[0].shape)
    stack = torch.full((k_max, *box), math.nan, dtype=dtype, device=device)
    for row, x in zip(stack, slices):
        row[leading_index(x.shape)].copy_(x)
    flat = stack.view(k_max, -1)
    count = (~flat.isnan()).sum(0)  # k: the clients covering each position
    cut = torch.tensor([math.floor(trim * k) for k in range(k_max + 1)], device=device)  # ⌊β·k⌋, as Python floors it
    if rule == "trimmed-mean" and not bool(cut.any()):  # nothing is trimmed anywhere: the unweighted mean, no sort
        return box, (flat.nansum(0) / count).view(box)
    ordered = flat.sort(dim=0).values  # NaN last: the k covering values of each position come first
    if rule == "median":
        lo = ordered.gather(0, ((count - 1).clamp(min=0) // 2).unsqueeze(0))[0]
        hi = ordered.gather(0, (count // 2).clamp(max=k_max - 1).unsqueeze(0))[0]
        middle = lo.mul_(0.5).add_(hi, alpha=0.5)  # halves first: no overflow, exact when lo == hi
        return box, torch.where(count > 0, middle, math.nan).view(box)
    t = cut[count]
    rank = torch.arange(k_max, device=device).unsqueeze(1)
    keep = (rank >= t) & (rank < count - t)
    kept = ordered.masked_fill_(~keep, 0).sum(0) / (count - 2 * t)  # 0/0 = NaN where nobody covers
    return box, kept.view(box)
