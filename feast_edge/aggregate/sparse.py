"""Sparse sample-weighted aggregation of routed payloads (method §6).

Each returned local state dict holds, per tensor name, the *leading slice* of
the global tensor of the same name that the client was routed (method §1, §5).
Every global position ``u`` becomes the sample-weighted mean over the cohort
clients whose payload contains it, and keeps its value when none does::

    θ_{t+1}[u] = Σ_{i: u∈U_i} n_i θ'_i[u] / Σ_{i: u∈U_i} n_i     (some client routed u)
    θ_{t+1}[u] = θ_t[u]                                           (otherwise)

Routing, not activation, decides membership: a routed position that no local
variant activated comes back unchanged and still enters the average. When every
client routes the full model this is exactly FedAvg.

:func:`aggregate` says this in three steps: check every payload, fold each
one's ``n_i θ'_i`` and ``n_i`` into the positions ``U_i`` it routed (largest
payload first), and take the ratio where some client routed ``u`` and
``θ_t[u]`` elsewhere. The folding is :class:`SparseAccumulator`
(:mod:`feast_edge.aggregate.accumulate`), which keeps a running mean instead of
the two sums while the boxes nest; the formula written literally, per position
and client, is the oracle it is tested against (``tests/core/test_aggregate.py``).

Buffers:

* BatchNorm ``running_mean`` / ``running_var`` are floating tensors and are
  treated exactly like weights: sample-weighted over the clients that routed
  each channel. method §8 recalibrates BN statistics before every evaluated
  operating point, so these averages only seed that recalibration.
* Integer buffers (``num_batches_tracked``) cannot be meaningfully averaged;
  they take the element-wise maximum over the clients that sent them, and keep
  the global value when no client did. Each client starts from the global
  counter, so the maximum never moves backwards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from feast_edge.aggregate.accumulate import SparseAccumulator
from feast_edge.aggregate.checks import StateDict, check_payload, check_samples
from feast_edge.errors import PayloadError

__all__ = ["PayloadError", "SparseAccumulator", "StateDict", "aggregate", "check_payload", "check_samples"]


def aggregate(
    global_state: StateDict,
    results: Iterable[tuple[StateDict, float]],
    dtype: torch.dtype = torch.float32,
    inplace: bool = False,
) -> dict[str, torch.Tensor]:
    """θ_{t+1} from θ_t (``global_state``) and the cohort's ``(θ'_i, n_i)`` payloads (method §6).

    Every payload is validated before anything is written, so a bad one raises
    :class:`PayloadError` and changes nothing. ``dtype`` is the accumulator's
    (float32, or float64 for an exact reference). ``inplace=True`` writes the
    new global state into ``global_state``'s own tensors and returns them (the
    federation loop does this to its model's state dict); otherwise new tensors
    are returned and ``global_state`` is left as it was.
    """
    payloads = _checked(global_state, results)
    sums = SparseAccumulator(global_state, dtype, inplace)
    sums.add_validated(_largest_first(payloads))  # Σ n_i θ'_i[u] and Σ n_i over u ∈ U_i; integer buffers: max θ'_i[u]
    return sums.result()  # their ratio where some client routed u, θ_t[u] elsewhere


def _checked(global_state: StateDict, results: Iterable[tuple[StateDict, float]]) -> list[tuple[StateDict, float]]:
    """The ``(θ'_i, n_i)`` pairs, every one validated before any is used."""
    checked = []
    for local_state, n_samples in results:
        n = check_samples(n_samples)
        check_payload(global_state, local_state)
        checked.append((local_state, n))
    return checked


def _largest_first(payloads: list[tuple[StateDict, float]]) -> list[tuple[StateDict, float]]:
    """Payloads by decreasing size, stably: nested envelopes (method §5.3) then nest box by box, the one-pass path.

    Stable, so the order, and with it every rounding, depends only on the given sequence.
    """
    return sorted(payloads, key=lambda p: -sum(t.numel() for t in p[0].values()))
