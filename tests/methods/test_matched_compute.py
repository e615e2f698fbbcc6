"""Matched training compute (--match-compute): a baseline gets the rounds that spend a FEAST run's compute."""

from __future__ import annotations

import json

import pytest

from feast_edge.sim.matched import matched_config, round_train_macs
from feast_edge.sim.registry import method_class
from feast_edge.sim.setup import SimulationConfig, SimulationError, build_setup
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config


def _config(fashion_mnist_dir, **changes) -> SimulationConfig:
    return tiny_config(fashion_mnist_dir, **{"seed": 2, **changes})


@pytest.fixture(scope="module")
def feast_run(tmp_path_factory, fashion_mnist_dir):
    out = tmp_path_factory.mktemp("feast")
    results = Simulation(_config(fashion_mnist_dir), out).run()
    return out, results


@pytest.mark.slow
@pytest.mark.parametrize("method", ["heterofl", "fiarse"])
def test_a_baseline_gets_the_fewest_rounds_that_spend_the_runs_compute(method, feast_run, fashion_mnist_dir, tmp_path):
    run, feast = feast_run
    target = feast["compute"]["train_macs_total"]
    config = _config(fashion_mnist_dir, method=method)
    setup = build_setup(config)
    matched_cfg, matched = matched_config(config, setup, run)
    assert matched.target_train_macs == target and matched.run_rounds == 2 and matched.run_method == "feast"
    # The fewest rounds: their predicted compute reaches the target, one round fewer does not.
    instance = method_class(method)(setup, matched_cfg)
    per_round = [round_train_macs(instance, setup, t) for t in range(matched.rounds)]
    assert sum(per_round) == matched.predicted_train_macs >= target > sum(per_round[:-1])
    results = Simulation(matched_cfg, tmp_path, setup=setup, matched=matched.to_dict()).run()
    # The prediction is what training reports, round by round (the rounds are fixed before the run starts).
    assert [r["train_macs"] for r in results["rounds"]] == per_round
    assert results["matched_compute"]["rounds"] == len(results["rounds"]) == matched.rounds
    assert json.loads((tmp_path / "results.json").read_text())["matched_compute"]["run"] == str(run)


@pytest.mark.slow
def test_feast_cannot_be_matched_and_another_population_is_refused(feast_run, fashion_mnist_dir):
    run, _ = feast_run
    config = _config(fashion_mnist_dir)
    with pytest.raises(SimulationError, match="draws what it trains per batch"):
        matched_config(config, build_setup(config), run)
    other = _config(fashion_mnist_dir, method="heterofl", seed=9)
    with pytest.raises(SimulationError, match="another population"):
        matched_config(other, build_setup(other), run)


def test_a_directory_without_results_is_a_one_line_error(cli, tmp_path, fashion_mnist_dir):
    result = cli.invoke(
        "simulate",
        "--out",
        str(tmp_path / "run"),
        "--method",
        "heterofl",
        "--clients",
        "4",
        "--per-round",
        "2",
        "--train-limit",
        "240",
        "--match-compute",
        str(tmp_path / "nothing"),
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --match-compute") and "results.json" in lines[0]
    assert not (tmp_path / "run").exists()


def test_rounds_are_replaced_not_added(fashion_mnist_dir, tmp_path):
    """The matched config differs from the given one only in its rounds."""
    config = _config(fashion_mnist_dir, method="heterofl", rounds=7)
    results = {
        "method": "feast",
        "rounds": [{}] * 3,
        "compute": {"train_macs_total": 1},
        "population": {},
    }
    setup = build_setup(config)
    results["population"] = {
        "budgets": [float(b) for b in setup.population.budgets],
        "shard_sizes": [int(n) for n in setup.population.sizes],
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    matched_cfg, matched = matched_config(config, setup, tmp_path)
    assert matched.rounds == 1 and matched_cfg == config.changed(rounds=1)
