"""The simulation's collector: a cohort's updates gathered in this process, each member trained by the method on its shard."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from feast_edge.run.collect import ClientUpdate, Collected
from feast_edge.sim.methods.base import Method
from feast_edge.sim.setup import Setup


class InProcessCollector:
    """Collects a cohort's updates in this process: the method trains each member on its shard."""

    def __init__(self, setup: Setup, method: Method, *, self_reported: bool = False) -> None:
        self.setup = setup
        self.method = method
        self.self_reported = self_reported  # treat the shards' sizes as the clients' own claims (--max-weight-ratio)
        self.budgets = {cid: float(b) for cid, b in zip(setup.client_ids, setup.population.budgets)}
        self.on_start: Callable[[int, Sequence[str], Mapping[str, Any]], None] | None = (
            None  # told each round's (t, cohort, plans)
        )

    def clients(self, needed: int) -> list[str]:
        return list(self.setup.client_ids)

    def fleet(self) -> list[str]:
        return list(self.setup.client_ids)

    def budget(self, client: str) -> float:
        return self.budgets[client]

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        if self.on_start is not None:
            self.on_start(t, cohort, plans)
        return self.collected(self.method.collect(t, cohort, plans, global_state, lr))

    def collected(self, updates: list[ClientUpdate]) -> Collected:
        """The round's updates, their counts marked as the clients' own claims when asked (``self_reported``)."""
        return Collected([replace(u, self_reported=True) for u in updates] if self.self_reported else updates)
