"""Synchronous rounds under secure aggregation (``--secure-agg``; docs/security.md §10): a cohort stratified by budget
tier, and plans cut to what the round can reveal, so that no routed slice trains for nothing.

    the fleet's cap   the highest tier at least c + 2 of the fleet's devices reach (feast_edge.route.reveal): the
                      variants above it cannot be revealed; said in one line at the first round, and again whenever
                      the fleet (a server's registered devices) changes it
    cohort            feast_edge.run.cohort.stratified_cohort over the online clients, each at its tier (at most the
                      fleet's cap): the uniform draw of m, its highest tier raised to c + 2 members where it can be
    plans             each member's plan (method §5) cut to the round's cap, the tier c + 2 of its members reach: every
                      routed segment has 0 or at least c + 2 members
    DP                the draw is not uniform: the round is accounted at its largest per-device inclusion
                      probability (feast_edge.run.cohort.inclusion; docs/privacy.md)

Without ``--secure-agg`` a run uses :class:`feast_edge.run.schedule.SyncRounds`, whose draw is unchanged.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from feast_edge.route.reveal import Reveal
from feast_edge.run.cohort import inclusion, stratified_cohort
from feast_edge.run.collect import Collector
from feast_edge.run.release import RoundContext
from feast_edge.run.schedule import Gathered, SyncRounds, step_lr

if TYPE_CHECKING:
    from feast_edge.run.round_record import RoundMethod, RoundRecord
    from feast_edge.settings.run_concerns import RunConcerns

log = logging.getLogger(__name__)


class StratifiedRounds(SyncRounds):
    """Secure rounds: a stratified cohort of ``per_round`` from the clients online, plans capped at what it reveals."""

    def __init__(self, settings: RunConcerns, method: RoundMethod, model: torch.nn.Module, reveal: Reveal) -> None:
        super().__init__(settings, method, model)
        self.reveal = reveal
        self.said: str | None = None  # the last line said about the fleet's cap
        self.cap: int | None = None  # the last round's cap, a tier (None: fewer than c + 2 members, nothing it
        # routes can be revealed)

    def gather(
        self,
        t: int,
        collector: Collector,
        needed: int,
        admit: Callable[[RoundContext], None],
        history: list[RoundRecord],
    ) -> Gathered:
        s, reveal = self.settings, self.reveal
        clients = collector.clients(needed)
        budgets = {c: collector.budget(c) for c in {*collector.fleet(), *clients}}
        tiers = {c: reveal.tier(b) for c, b in budgets.items()}
        fleet_cap = reveal.cap(tiers.values())
        self._say(reveal.words(reveal.unrevealed(budgets.values())))
        drawn = {c: tiers[c] if fleet_cap is None else min(tiers[c], fleet_cap) for c in clients}
        m = min(s.population.per_round, len(clients))
        cohort = stratified_cohort(clients, drawn, m, reveal.least, s.seed, t)
        ctx = RoundContext(t, len(clients), cohort, history, inclusion=self._inclusion(drawn, m))
        admit(ctx)
        lr = step_lr(s, t, history)
        plans = self.method.plans(t, cohort, collector.budget)
        self.cap = cap = reveal.cap(drawn[c] for c in cohort)
        plans = {c: reveal.capped(plan, 0 if cap is None else cap) for c, plan in plans.items()}
        global_state = self.model.state_dict()  # aliases the model's tensors: the release writes into the model
        return Gathered(ctx, plans, lr, collector.collect(t, cohort, plans, global_state, lr))

    def _say(self, line: str) -> None:
        """The fleet's cap in one line: at the first round, and whenever it changes."""
        if line != self.said:
            if self.said is not None or "cannot be revealed" in line:
                log.info("%s", line)
            self.said = line

    def _inclusion(self, tiers: dict[str, int], m: int) -> float | None:
        """Under DP, the largest probability that one client is in the cohort; None where it is a uniform draw's,
        m / N (no tier is ever raised), or without DP (not needed)."""
        if self.settings.dp is None:
            return None
        sizes = Counter(tiers.values())
        largest = max(inclusion([sizes[k] for k in sorted(sizes)], m, self.reveal.least))
        return largest if largest > m / len(tiers) + 1e-12 else None
