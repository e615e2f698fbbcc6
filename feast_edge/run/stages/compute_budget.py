"""A budget of training compute: the run ends before the step that would start once the released updates' training
MACs (Σ of the rounds' ``train_macs``) reached ``--compute-budget``, saying so. Comparing synchronous and asynchronous
rounds at the same client compute is what it is for (bench/bench_async.py): an asynchronous run releases many cheap
updates of fast devices, so equal update counts are not equal work."""

from __future__ import annotations

from feast_edge.run.release import BaseStage, RoundContext, RunStops


class ComputeBudgetStage(BaseStage):
    """Refuse the next step once the history's training MACs reached ``budget``."""

    takes_sums = True

    def __init__(self, budget: float) -> None:
        self.budget = budget

    def admit(self, ctx: RoundContext) -> None:
        spent = sum(h.train_macs for h in ctx.history)
        if spent >= self.budget:
            raise RunStops(
                f"the compute budget is spent after round {len(ctx.history)}: {spent / 1e12:.3f} TMAC of training "
                f"reached --compute-budget {self.budget / 1e12:.3f} TMAC"
            )
