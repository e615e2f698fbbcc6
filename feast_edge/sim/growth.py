"""A simulated population over time: clients that join as the run goes on and shards that grow (docs/simulation.md,
"Clients that join and shards that grow"). Both are counted in steps t (0-based synchronous rounds, or asynchronous
releases), never in virtual seconds, so they do not depend on the clock's model; both are seeded and fixed before the
first round.

    arrivals  N0 = max(1, ⌈p0 · N⌉) clients (--joined-at-start p0), the first N0 of a permutation of the clients
              seeded by (seed, 13), take part from step 0; the other L = N - N0, in that permutation's order, join at
              steps a_k = ⌈(k + 1) · R / L⌉, k = 0 .. L-1 (--join-rounds R): evenly spread, the last at step R. A
              client is drawn into a cohort only from its step on (:class:`Present`).
    shards    client i holds n_i training examples (its shard less its held-out split, which is drawn over the whole
              shard once, never trains and never moves) and sees the first
                  v_i(t) = max(1, ⌈n_i · min(1, s0 + r · max(0, t - a_i))⌉)
              of them (--shard-start s0, --shard-growth r): a share s0 when it joins, r more each step after, until the
              whole shard. Which examples: a permutation of its training examples seeded by (seed, 14, i), so each
              step's are the last step's and more; they train in shard order, so a whole shard is exactly the shard.
    drift     D clients (--drift-clients D), the first D of a permutation of the clients seeded by (seed, 15), reveal
              their examples class after class: that permutation stably sorted by each example's rank in an order of
              the classes seeded by (seed, 16, i), so the images a drifting shard grows by come from shifting classes.
              Their held-out and test examples at step t are those of the classes they hold at t (what a device
              whose photos change subject holds out of them); everyone else's stay whole.

With everyone present and whole shards (the defaults) nothing here is built, and a run is what it was before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feast_edge.run.collect import Collected, Collector, Wrapped
from feast_edge.settings.validated import RunError

_ARRIVALS, _REVEAL, _DRIFTING, _CLASS_ORDER = 13, 14, 15, 16  # seed streams (feast_edge.sim.setup's use 11, 12)
_EPS = 1e-9  # a share times a count that is an integer in exact arithmetic stays that integer (0.3 · 10 is 3)


def ceil_share(share: float, n: int) -> int:
    """⌈share · n⌉, robust to the float error of a product that is an integer."""
    return math.ceil(share * n - _EPS)


def join_steps(client_ids: Sequence[str], joined_at_start: float, join_rounds: int, seed: int) -> dict[str, int]:
    """Each client's first step (see the module docstring's arrivals)."""
    n = len(client_ids)
    order = np.random.default_rng([seed, _ARRIVALS]).permutation(n)
    first = max(1, ceil_share(joined_at_start, n))
    late = n - first
    steps = {client_ids[i]: 0 for i in order[:first]}
    steps.update({client_ids[i]: -(-(k + 1) * join_rounds // late) for k, i in enumerate(order[first:])})
    return dict(sorted(steps.items()))


def drifting_clients(client_ids: Sequence[str], count: int, seed: int) -> tuple[str, ...]:
    """The ``count`` clients whose class mix drifts (see the module docstring's drift), sorted."""
    order = np.random.default_rng([seed, _DRIFTING]).permutation(len(client_ids))
    return tuple(sorted(client_ids[i] for i in order[:count]))


@dataclass(frozen=True)
class Growth:
    """When each client joins and how much of its shard it sees at step ``t`` (see the module docstring)."""

    joined: Mapping[str, int]  # client -> its first step (0: from the first round)
    sizes: Mapping[str, int]  # client -> its training examples n_i (the shard less its held-out split)
    shard_start: float
    shard_growth: float
    seed: int
    drifting: tuple[str, ...] = ()  # clients whose examples come class after class
    until: int | None = None  # the population as it stood at this step from then on (None: it goes on changing)

    @classmethod
    def of(cls, population: Any, client_ids: Sequence[str], sizes: Sequence[int], seed: int) -> Growth:
        """The model of a simulation's population settings (feast_edge.sim.config.ClientPopulation)."""
        joined = join_steps(client_ids, population.joined_at_start, population.join_rounds, seed)
        return cls(
            joined,
            dict(zip(client_ids, (int(n) for n in sizes))),
            population.shard_start,
            population.shard_growth,
            seed,
            drifting_clients(client_ids, population.drift_clients, seed),
        )

    def frozen_at(self, t: int) -> Growth:
        """This population as it stands at step ``t``, unchanged after it (a model retrained from scratch on the data
        so far): who has joined and what each holds then."""
        return dataclasses.replace(self, until=t)

    def _step(self, t: int) -> int:
        return t if self.until is None else min(t, self.until)

    def present(self, clients: Sequence[str], t: int) -> list[str]:
        """The ``clients`` that have joined by step ``t``."""
        return [c for c in clients if self.joined[c] <= self._step(t)]

    def visible(self, client: str, t: int) -> int:
        """v_i(t): how many of ``client``'s training examples it holds at step ``t`` (before it joins: its start)."""
        n = self.sizes[client]
        share = min(1.0, self.shard_start + self.shard_growth * max(0, self._step(t) - self.joined[client]))
        return min(n, max(1, ceil_share(share, n)))

    def revealed(self, client: str, index: int, t: int, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The positions (sorted, into ``client``'s training examples) it holds at step ``t``; ``index``: its place in
        the population (the permutation's seed); ``labels``: its training examples' classes (a drifting client
        reveals them class after class)."""
        order = np.random.default_rng([self.seed, _REVEAL, index]).permutation(self.sizes[client])
        if client in self.drifting:
            if labels is None:
                raise ValueError(f"{client} drifts: its examples' labels say which come first")
            ranks = np.argsort(self.class_order(index, int(labels.max()) + 1))
            order = order[np.argsort(ranks[labels.numpy()[order]], kind="stable")]
        return torch.from_numpy(np.sort(order[: self.visible(client, t)]))

    def class_order(self, index: int, classes: int) -> np.ndarray:
        """The order a drifting client's classes come in (``index``: its place in the population)."""
        return np.random.default_rng([self.seed, _CLASS_ORDER, index]).permutation(classes)

    def counts(self, t: int) -> tuple[int, int]:
        """(clients present, training examples they hold) at step ``t``: what a round's record reports."""
        present = self.present(list(self.joined), t)
        return len(present), sum(self.visible(c, t) for c in present)

    def summary(self) -> dict[str, Any]:
        """results.json's ``growth``: each client's first round (1-based) and the shards' rule."""
        return {
            "joined_round": {c: a + 1 for c, a in self.joined.items()},
            "shard_start": self.shard_start,
            "shard_growth": self.shard_growth,
            "training_examples": dict(self.sizes),
            **({"drifting": list(self.drifting)} if self.drifting else {}),
        }


class Present(Wrapped):
    """A simulation's clients that join over time: a cohort is drawn only from those that have joined by the step it
    is drawn for. ``step()`` says which step that is (the simulation's environment counts the releases)."""

    def __init__(self, inner: Collector, growth: Growth, step: Callable[[], int]) -> None:
        super().__init__(inner)
        self.growth, self.step = growth, step

    def clients(self, needed: int) -> list[str]:
        return self.growth.present(self.inner.clients(needed), self.step())

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        early = [c for c in cohort if self.growth.joined[c] > t]
        if early:  # a defect, not a setting: the draw came from another step's clients
            raise RunError(f"round {t + 1} drew {', '.join(early)} before they joined (feast_edge.sim.growth)")
        return self.inner.collect(t, cohort, plans, global_state, lr)


def over_time_checks(population: Any) -> list[tuple[bool, str]]:
    """(allowed, why) of a simulation's population settings over time (a ClientPopulation): shares in (0, 1], and
    each option with what makes it do something."""
    pop, late = population, population.joined_at_start < 1
    return [
        (0 < pop.joined_at_start <= 1, f"--joined-at-start {pop.joined_at_start} must be a share in (0, 1]"),
        (0 < pop.shard_start <= 1, f"--shard-start {pop.shard_start} must be a share in (0, 1]"),
        (pop.shard_growth >= 0, f"--shard-growth {pop.shard_growth} must be >= 0 (0: shards do not grow)"),
        (late == (pop.join_rounds > 0), ("--joined-at-start below 1 and --join-rounds R go together: the clients "
         "absent at round 1 join over R rounds (e.g. --joined-at-start 0.25 --join-rounds 20)")),
        (not pop.shard_growth or pop.shard_start < 1, (f"--shard-growth {pop.shard_growth} grows shards that start "
         "partial: give --shard-start below 1 (e.g. 0.2)")),
        (not pop.drift_clients or pop.shard_start < 1, (f"--drift-clients {pop.drift_clients} drifts the images "
         "shards grow by: give --shard-start below 1 and --shard-growth (e.g. 0.2 and 0.05)")),
    ]  # fmt: skip


def over_time_refusals(config: Any) -> list[tuple[bool, str]]:
    """(allowed, why) of a simulation's population over time with its other settings (a SimulationConfig)."""
    pop = config.population
    if not pop.over_time:
        return []
    first = max(1, ceil_share(pop.joined_at_start, pop.clients))
    return [
        (config.method != "centralized", ("--method centralized trains on every client's pooled data from round "
         "1: clients that join and shards that grow apply to the federated methods")),
        (config.schedule.mode != "async" or first >= config.schedule.buffer, (f"--mode async with --joined-at-start "
         f"{pop.joined_at_start:g}: the {first} clients present at the first release cannot fill --buffer "
         f"{config.schedule.buffer}; raise --joined-at-start or lower --buffer")),
    ]  # fmt: skip
