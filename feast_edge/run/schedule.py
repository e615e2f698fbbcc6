"""Who trains next: a scheduler hands the run loop each step's cohort, their plans and what they sent back.

    SyncRounds (method §4)   each round: the clients online (at least ``needed``), a cohort of m drawn uniformly
                             with the seed of (seed, t), each member's plan, one collection with a deadline

The loop (feast_edge.run.loop) asks ``scheduler.gather(t, collector, needed, admit)`` for step ``t`` and hands what
comes back to the release policy (feast_edge.run.policy); ``admit`` runs once the cohort is known and before
anything is sent, so a release stage may still refuse the step (a privacy budget). Another way of choosing who
trains (asynchronous slots that refill as devices finish) is another class with this method, not an edit of the
loop (CONTRIBUTING.md, "Where a change goes").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from feast_edge.local.recipe import continuous_lr, cosine_lr, scheduled_lr
from feast_edge.run.cohort import sample_round_cohort
from feast_edge.run.collect import Collected, Collector
from feast_edge.run.release import RoundContext

if TYPE_CHECKING:
    from feast_edge.run.round_record import RoundMethod, RoundRecord
    from feast_edge.settings.run_concerns import RunConcerns


@dataclass
class Gathered:
    """One step's input to the release: who was asked, with which plans and learning rate, and what came back."""

    ctx: RoundContext
    plans: Mapping[str, Any]
    lr: float
    got: Collected


class Scheduler(Protocol):
    """Who trains next (see the module docstring)."""

    def gather(
        self,
        t: int,
        collector: Collector,
        needed: int,
        admit: Callable[[RoundContext], None],
        history: list[RoundRecord],
    ) -> Gathered: ...

    def resume(self, history: list[RoundRecord]) -> None:
        """A resumed run goes on after ``history`` (its clock, its draws)."""


def step_lr(settings: RunConcerns, t: int, history: list[RoundRecord]) -> float:
    """Step ``t``'s learning rate: the schedule over ``--rounds``, restarted cycles without a horizon, or, under ``--compute-budget``, over the share of
    the budget the released updates spent (an asynchronous run's number of releases is not known in advance)."""
    s = settings
    if s.compute_budget > 0 and s.lr_schedule != "constant":
        spent = min(sum(h.train_macs for h in history), s.compute_budget)
        return cosine_lr(s.lr, round(1000 * spent / s.compute_budget), 1001)
    if s.training.continuous:  # no horizon: cosine cycles restarted every --lr-period rounds
        return continuous_lr(s.lr, t, s.training.lr_period)
    return scheduled_lr(s.lr_schedule, s.lr, t, s.training.rounds)


class SyncRounds:
    """Synchronous rounds: a seeded uniform cohort of ``per_round`` from the clients online, collected together."""

    def __init__(self, settings: RunConcerns, method: RoundMethod, model: torch.nn.Module) -> None:
        self.settings = settings
        self.method = method
        self.model = model

    def resume(self, history: list[RoundRecord]) -> None:
        """Nothing to restore: round t's cohort is drawn with the seed of (seed, t)."""

    def gather(
        self,
        t: int,
        collector: Collector,
        needed: int,
        admit: Callable[[RoundContext], None],
        history: list[RoundRecord],
    ) -> Gathered:
        s = self.settings
        clients = collector.clients(needed)
        cohort = sample_round_cohort(clients, min(s.population.per_round, len(clients)), s.seed, t)
        ctx = RoundContext(t, len(clients), list(cohort), history)
        admit(ctx)
        lr = step_lr(s, t, history)
        plans = self.method.plans(t, cohort, collector.budget)
        global_state = self.model.state_dict()  # aliases the model's tensors: the release writes into the model
        return Gathered(ctx, plans, lr, collector.collect(t, cohort, plans, global_state, lr))
