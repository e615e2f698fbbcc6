"""Matched training compute: as many rounds of a method as spend the training compute a finished run spent (issue 23).

The paper's matched-compute experiment gives each baseline the rounds it needs to
spend FEAST's training compute (CIFAR-100: FIARSE 4,139, HeteroFL 8,286, ScaleFL
8,150 rounds against FEAST's 4,000). The compute is the harness's MAC proxy
(method §7: forward + backward ≈ 3 × forward MACs per trained sample), summed over
the rounds (``results.json``: ``compute.train_macs_total``).

A baseline trains one fixed network per client and round, so its compute is known
before it trains: round ``t`` samples its cohort and plans from ``(seed, t)``
alone (``feast_edge.run.cohort``), and each member spends
``3 × epochs × n_i × MACs(plan_i)`` (:meth:`Method.sample_train_macs`). The rounds
are the fewest whose predicted compute reaches the target, fixed before the run
starts, so the learning-rate schedule spans the whole matched horizon as it
would for any run of that length. FEAST draws its variants per batch, so its own
compute is only known afterwards; it is the run others are matched to.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from feast_edge.run.cohort import sample_round_cohort
from feast_edge.sim.methods.base import Method
from feast_edge.sim.registry import method_class
from feast_edge.sim.setup import Setup, SimulationConfig, SimulationError

MAX_FACTOR = 100  # at most this many times the matched run's rounds (a method far cheaper per round is refused)


@dataclass(frozen=True)
class MatchedCompute:
    """The rounds that match a run's training compute, and the figures they came from."""

    run: str  # the run matched to
    run_method: str
    run_rounds: int
    target_train_macs: int  # what that run spent
    rounds: int  # this method's rounds
    predicted_train_macs: int  # what they spend, predicted before training

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Target:
    """What a finished run spent, and on which population."""

    method: str
    rounds: int
    train_macs: int
    budgets: list[float]
    shard_sizes: list[int]


def read_target(run: Path) -> Target:
    """The finished run's compute, rounds and population from its results.json; a one-line error if it is not one."""
    path = Path(run) / "results.json"
    fix = "pass the directory of a finished feast-edge simulate run (it holds results.json)"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
        return Target(
            str(results.get("method", "feast")),
            len(results["rounds"]),
            int(results["compute"]["train_macs_total"]),
            [float(b) for b in results["population"]["budgets"]],
            [int(n) for n in results["population"]["shard_sizes"]],
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SimulationError(f"--match-compute {run}: cannot read {path} ({exc!r}); {fix}") from None


def round_train_macs(method: Method, setup: Setup, t: int) -> int:
    """The training compute round ``t`` will spend (its cohort and plans are pure functions of the seed and ``t``)."""
    config = method.config
    clients = list(setup.client_ids)
    cohort = sample_round_cohort(clients, min(config.population.per_round, len(clients)), config.seed, t)
    budgets = dict(zip(setup.client_ids, (float(b) for b in setup.population.budgets)))
    plans = method.plans(t, cohort, budgets.__getitem__)
    epochs = config.train_config().epochs
    shard = dict(zip(setup.client_ids, (int(n) for n in setup.population.sizes)))  # sizes, not the images
    total = 0
    for client in cohort:
        macs = method.sample_train_macs(plans[client])
        if macs is None:
            raise SimulationError(
                f"--match-compute: {method.name} draws what it trains per batch, so its compute is only known after "
                "a round; match a baseline to a FEAST run instead"
            )
        total += 3 * epochs * shard[client] * macs
    return total


def matched_rounds(method: Method, setup: Setup, run: Path) -> MatchedCompute:
    """The fewest rounds of ``method`` whose predicted training compute reaches the finished ``run``'s."""
    target = read_target(run)
    mine = setup.population
    if target.budgets != [float(b) for b in mine.budgets] or target.shard_sizes != [int(n) for n in mine.sizes]:
        raise SimulationError(
            f"--match-compute {run}: that run trained another population (its budgets or shard sizes differ); "
            "use the same --clients, --gamma, --zipf-s, --train-limit and --seed"
        )
    if target.train_macs <= 0:
        raise SimulationError(f"--match-compute {run}: that run spent no training compute; match a run that trained")
    spent, t = 0, 0
    while spent < target.train_macs:
        if t >= MAX_FACTOR * max(target.rounds, 1):
            raise SimulationError(
                f"--match-compute {run}: {method.name} would need more than {MAX_FACTOR}× that run's {target.rounds} "
                "rounds to spend its compute; compare at equal rounds instead"
            )
        spent += round_train_macs(method, setup, t)
        t += 1
    return MatchedCompute(str(run), target.method, target.rounds, target.train_macs, t, spent)


def matched_config(config: SimulationConfig, setup: Setup, run: Path) -> tuple[SimulationConfig, MatchedCompute]:
    """``config`` with the rounds that match ``run``'s training compute, and how they were found."""
    matched = matched_rounds(method_class(config.method)(setup, config), setup, run)
    return config.changed(rounds=matched.rounds), matched
