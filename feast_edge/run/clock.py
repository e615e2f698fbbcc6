"""The virtual clock of a simulation: how long each client's job would take on the device it stands for.

    train        = train_macs / throughput_i        train_macs: 3 · Σ_batches n · Σ MAC(variants trained), what the
                                                    client reports (forward and backward, every local epoch)
    throughput_i = rate · budget_i / max budget     the strongest client trains at ``rate`` MAC/s (--clock-rate,
                                                    default RATE, measured on a Zen 3 EPYC core); tiers scale with budget
    transfer     = 2 · routed bytes / link          its slice down and its update up (--link-mbps)
    stragglers   a seeded share of the clients (--stragglers) is --straggler-factor times slower in both
    jitter       each job × exp(σ · N(0, 1)), seeded by (seed, job) (--jitter σ)
    dropouts     each job is lost with probability --dropout (seeded), after its whole duration

``--clock uniform`` makes every job take one second before stragglers and jitter (without them, what makes buffered
asynchronous rounds with K = M = the cohort equal synchronous ones; with jitter, staleness without a device's speed
deciding how often it trains). Synchronous rounds (``TimedRounds``, a collector wrapper) last as long as
their slowest member, or ``--round-timeout`` virtual seconds, after which the late updates are dropped as a server's
deadline drops them; asynchronous ones read the clock directly (feast_edge.run.asynchronous).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from feast_edge.route.payload import bytes_per_param
from feast_edge.run.collect import REFUSED, STALE, ClientUpdate, Collected, Collector, Wrapped
from feast_edge.run.round_record import RoundRecord

RATE = 1.3e10  # MAC/s of FEAST training on one Zen 3 EPYC core (docs/simulation.md, "The virtual clock")
CLOCKS = ("tiers", "uniform")
_STRAGGLERS, _JITTER, _DROPOUT = 1, 2, 3  # seed streams
JOBS_PER_ROUND = 1_000_000  # a synchronous round's jobs are numbered t · JOBS_PER_ROUND + k (their seeds)


@dataclass(frozen=True)
class ClockModel:
    """The clock's settings (see the module docstring)."""

    kind: str = "tiers"
    rate: float = RATE
    link_mbps: float = 20.0
    stragglers: float = 0.0
    straggler_factor: float = 10.0
    jitter: float = 0.0
    dropout: float = 0.0


class VirtualClock:
    """Durations of the clients' jobs under a :class:`ClockModel`, seeded (see the module docstring)."""

    def __init__(
        self,
        model: ClockModel,
        budgets: Mapping[str, float],
        seed: int,
        payload_params: Callable[[Any], int],
        payload_dtype: str = "float32",
    ) -> None:
        self.model, self.budgets, self.seed = model, dict(budgets), seed
        self.payload_params, self.bytes = payload_params, bytes_per_param(payload_dtype)
        top = max(self.budgets.values())
        self.throughput = {c: model.rate * b / top for c, b in self.budgets.items()}
        ids = sorted(self.budgets)
        slow = np.random.default_rng([seed, _STRAGGLERS]).random(len(ids)) < model.stragglers
        self.slow = {c for c, s in zip(ids, slow) if s}

    def duration(self, client: str, update: ClientUpdate, plan: Any, job: int) -> float:
        """Seconds from sending ``client`` its slice to its update arriving (job ``job``: the jitter's seed)."""
        m = self.model
        seconds = 1.0 if m.kind == "uniform" else self._work(client, update, plan)
        seconds *= m.straggler_factor if client in self.slow else 1.0
        if m.jitter > 0:
            seconds *= math.exp(m.jitter * float(np.random.default_rng([self.seed, _JITTER, job]).standard_normal()))
        return seconds

    def _work(self, client: str, update: ClientUpdate, plan: Any) -> float:
        """Training and transfer seconds on the tiers clock; a trainer that is no client (the centralized reference's
        pooled data) trains at the top rate and sends nothing."""
        m = self.model
        train = update.train_macs / self.throughput.get(client, m.rate)
        return train + (0.0 if plan is None else 2 * self.payload_params(plan) * self.bytes / (m.link_mbps * 1e6 / 8))

    def drops(self, client: str, job: int) -> bool:
        """Whether job ``job`` is lost (the device slept or lost its link), seeded."""
        p = self.model.dropout
        return p > 0 and float(np.random.default_rng([self.seed, _DROPOUT, job]).random()) < p


class TimedRounds(Wrapped):
    """Synchronous rounds on the virtual clock: each round lasts as long as its slowest member, or ``timeout``
    virtual seconds (0: no limit), after which the late updates are dropped (``missing``), as a server's deadline
    drops them. ``now`` is the clock after the last round."""

    def __init__(self, inner: Collector, clock: VirtualClock, timeout: float = 0.0, now: float = 0.0) -> None:
        super().__init__(inner)
        self.clock, self.timeout = clock, timeout
        self.now = now

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        got = self.inner.collect(t, cohort, plans, global_state, lr)
        kept, late, lost, took = [], [], [], {}
        for k, u in enumerate(got.updates):
            job = t * JOBS_PER_ROUND + k
            seconds = self.clock.duration(u.client, u, plans.get(u.client), job)
            took[u.client] = seconds
            if self.clock.drops(u.client, job):
                lost.append(u.client)
            elif self.timeout and seconds > self.timeout:
                late.append(u.client)
            else:
                kept.append(u)
        waited = max(took.values(), default=0.0)
        self.now += min(waited, self.timeout) if self.timeout else waited
        return replace(
            got,
            updates=kept,
            missing=sorted([*got.missing, *late]),
            dropped=sorted([*got.dropped, *lost]),
            clock=self.now,
            durations={c: round(s, 6) for c, s in took.items()},
        )


def timeline(history: Sequence[RoundRecord], mode: str) -> dict[str, Any]:
    """results.json's ``timeline``: the virtual time, the releases, the released updates' staleness (mean, max, and
    updates refused as too stale), each client's released updates, and the validation accuracy against time."""
    taus = [tau for h in history for tau in h.staleness.values()]
    participation: dict[str, int] = {}
    for h in history:
        for client in h.updated:
            participation[client] = participation.get(client, 0) + 1
    return {
        "mode": mode,
        "virtual_seconds": history[-1].clock if history else 0.0,
        "releases": sum(h.applied for h in history),
        "staleness": {
            "mean": sum(taus) / len(taus) if taus else 0.0,
            "max": max(taus, default=0),
            "refused": sum(kind == STALE for h in history for kind in h.refusals.values()),
        },
        # every refused update by its kind (a refusal without one: REFUSED): staleness, a bound, a bad payload
        "refused_by_kind": dict(
            sorted(Counter(h.refusals.get(c, REFUSED) for h in history for c in h.rejected).items())
        ),
        "dropped": sum(len(h.dropped) for h in history),
        "late": sum(len(h.missing) for h in history),
        "participation": dict(sorted(participation.items())),
        "accuracy_vs_time": [[h.clock, h.val_accuracy] for h in history if h.val_accuracy is not None],
    }


def clock_entry(clock: float | None, staleness: Mapping[str, int]) -> dict[str, Any]:
    """A step's virtual clock and its released updates' staleness (mean, max) for a dashboard history entry; {} for a
    run without a clock (a federation measures real time)."""
    if clock is None:
        return {}
    taus = list(staleness.values())
    return {
        "clock": clock,
        "staleness_mean": sum(taus) / len(taus) if taus else None,
        "staleness_max": max(taus, default=None),
    }
