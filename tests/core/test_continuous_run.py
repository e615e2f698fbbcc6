"""A run without a horizon (--continuous) in the core: the learning rate without an end, a tail mean at every
validation, what older rounds keep (feast_edge.run.retention), what --continuous refuses, the fingerprint rule that
lets a run be extended, and a continuous simulation that computes the same whether it stops on the way or not."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from feast_edge.evaluate.served_round import served_round
from feast_edge.local.recipe import CONTINUOUS_PERIOD, continuous_lr
from feast_edge.run.average import TailAverage, serve_average_of
from feast_edge.run.checkpoint import load_supernet, read_record
from feast_edge.run.retention import KEEP_FULL, compact, retain, retained, written
from feast_edge.run.round_record import RoundRecord
from feast_edge.run.roundlog import round_row
from feast_edge.run.store import CHECKPOINT
from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.sim.config import SimulationError
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config


def test_the_learning_rate_without_an_end_restarts_its_cosine_every_period_or_stays_constant() -> None:
    assert [continuous_lr(0.1, t, 0) for t in (0, 7, 1000)] == [0.1, 0.1, 0.1]
    cycle = [continuous_lr(0.1, t, 4) for t in range(9)]
    assert cycle[0] == cycle[4] == cycle[8] == pytest.approx(0.1)  # restarted at its peak
    assert cycle[2] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert cycle[1] > cycle[2] > cycle[3] > 0
    assert CONTINUOUS_PERIOD >= 1


def _states(rounds: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"w": torch.randn(3, generator=g)} for _ in range(rounds)]


def test_without_a_horizon_every_validation_has_the_mean_of_the_last_rounds_before_it() -> None:
    k = serve_average_of(None, True, None, every=5)
    assert k == 5 and serve_average_of(None, True, None, every=2) == 2 and serve_average_of(3, True, None, 2) == 2
    assert serve_average_of(None, False, None, every=5) == 1  # server-held data: the paper's selection
    average, states = TailAverage(None, 3, every=5), _states(12)
    spans = {}
    for r, state in enumerate(states, start=1):
        average.add(r, state)
        candidate = average.candidate(r)
        if candidate is not None:
            span, mean = candidate
            spans[r] = span
            expected = torch.stack([s["w"] for s in states[span[0] - 1 : span[1]]]).mean(0)
            assert torch.allclose(mean["w"], expected, atol=1e-6)
    assert spans == {5: (3, 5), 10: (8, 10)}
    # A finite run's window is what it always was: the last k rounds before its last.
    finite = TailAverage(12, 3)
    for r, state in enumerate(states, start=1):
        finite.add(r, state)
    assert [r for r in range(1, 13) if finite.stands_in(r)] == [12] and finite.span == (10, 12)


def _record(r: int, validated: bool) -> RoundRecord:
    figures = {d: [f"v{r % 3}", 40 + r, 80] for d in ("a", "b", "c")}
    return RoundRecord(
        round=r, lr=0.1, cohort=["a", "b", "c"], updated=["a", "b"], rejected={"c": "stale: a long reason " * 5},
        declined={}, missing=[], compute_seconds={"a": 1.5, "b": 2.0}, durations={"a": 3.0},
        variants_per_batch={"3": 12}, loss=1.0 / r, samples=300, train_macs=10**9, routed_bytes=123, seconds=2.5,
        val_accuracy=0.5 if validated else None,
        validation={"source": "devices", "served": figures, "flagged": {}, "points": {"v1": 0.5, "v2": 0.4},
                    "examples": {"v1": 80}, "devices": ["a", "b", "c"]} if validated else {},
    )  # fmt: skip


def test_an_older_round_keeps_its_figures_and_what_the_served_round_rule_reads_not_its_details() -> None:
    history = [_record(r, r % 5 == 0) for r in range(1, 121)]
    kept = retained(history)
    assert len(kept) == 120 and kept[-KEEP_FULL:] == history[-KEEP_FULL:]
    for full, small in zip(history, kept):
        assert round_row(small) == round_row(full)  # rounds.csv is the same
    old = kept[9]
    assert old.compute_seconds == {} and old.durations == {} and old.variants_per_batch == {}
    assert old.rejected == {"c": ""} and "points" not in old.validation and old.validation["served"]
    validations = lambda h: [(x.round, x.validation) for x in h if x.validation]  # noqa: E731
    assert served_round(validations(kept)) == served_round(validations(history))
    # Appending round by round compacts exactly the round that left the window.
    grown: list[RoundRecord] = []
    for record in history:
        grown.append(record)
        retain(grown)
    assert grown == kept
    assert compact(compact(history[0])) == compact(history[0])
    stored = written(kept, endless=True)
    older = len(history) - KEEP_FULL
    assert len(json.dumps(stored[:older])) < 0.4 * len(json.dumps([asdict(h) for h in history[:older]]))
    assert [RoundRecord.from_dict(h) for h in stored] == kept  # read back as kept
    assert written(history, endless=False) == [asdict(h) for h in history]  # a finite run stores every round whole


def test_continuous_refuses_asynchronous_rounds_and_differential_privacy_with_the_reason() -> None:
    with pytest.raises(SimulationError, match="--continuous with --mode async: the served model is chosen"):
        tiny_config(continuous=True, mode="async", buffer=2, concurrency=2)
    with pytest.raises(SimulationError, match="--continuous with differential privacy"):
        tiny_config(continuous=True, dp_clip=1.0, dp_noise=1.0)
    with pytest.raises(SimulationError, match="--continuous with --compute-budget"):
        tiny_config(continuous=True, compute_budget=1e12)
    with pytest.raises(ServerError, match="--continuous with differential privacy"):
        ServerConfig.of(out="x", federation="f", continuous=True, dp_clip=1.0, dp_noise=1.0)


def test_the_horizon_leaves_the_fingerprint_only_without_an_end() -> None:
    finite = ServerConfig.of(out="x", federation="f", rounds=6).decisive()
    assert finite["rounds"] == 6 and "continuous" not in finite and "lr_period" not in finite
    endless = ServerConfig.of(out="x", federation="f", rounds=6, continuous=True).decisive()
    assert "rounds" not in endless and endless["continuous"] is True and endless["lr_period"] == CONTINUOUS_PERIOD
    assert ServerConfig.of(out="x", federation="f", rounds=9, continuous=True).decisive() == endless
    simulated = tiny_config(rounds=6).decisive()
    assert simulated["rounds"] == 6 and "continuous" not in simulated


@pytest.mark.slow
def test_a_continuous_simulation_stopped_and_resumed_computes_what_one_uninterrupted_run_does(tmp_path) -> None:
    def config(rounds: int):
        return tiny_config(rounds=rounds, continuous=True, lr_period=3, eval_every=2, seed=4)

    Simulation(config(5), tmp_path / "straight").run()
    Simulation(config(2), tmp_path / "stopped").run()
    resumed = Simulation(config(5), tmp_path / "stopped")
    resumed.run(resume=True)
    a = load_supernet(tmp_path / "straight" / CHECKPOINT)[0].state_dict()
    b = load_supernet(tmp_path / "stopped" / CHECKPOINT)[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    lrs = [h["lr"] for h in read_record(tmp_path / "stopped" / CHECKPOINT)["fields"]["history"]]
    assert lrs[0] == lrs[3] and lrs[1] < lrs[0]  # cycles of 3 rounds, not a decay over --rounds
    # A finite run stopped short of its horizon is refused a smaller --rounds, with the reason.
    Simulation(tiny_config(rounds=3), tmp_path / "finite").run()
    with pytest.raises(SimulationError, match="has completed 3 rounds, more than --rounds 2"):
        Simulation(tiny_config(rounds=2), tmp_path / "finite").run(resume=True)
