"""The harness every method runs in: same-seed determinism, exact resume, bad input, the centralized reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from feast_edge.run.cohort import sample_round_cohort
from feast_edge.sim.methods import METHODS, MethodError, method_class
from feast_edge.sim.setup import SimulationConfig, SimulationError
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config

# Every method on the fmnist-tiny preset, validated each round.
SETTINGS = dict(
    train_limit=400, val_samples=200, calib_samples=100, test_limit=200, eval_every=1, probe_variants=2, batch_size=64
)


def _config(fashion_mnist_dir, method: str, **changes) -> SimulationConfig:
    return tiny_config(fashion_mnist_dir, method=method, **{**SETTINGS, **changes})


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_resumed_run_ends_bit_identical_to_an_uninterrupted_one(method, fashion_mnist_dir, tmp_path):
    config = _config(fashion_mnist_dir, method)
    whole = Simulation(config, tmp_path / "whole").run()
    assert Simulation(config, tmp_path / "split").run(stop_after=1) is None
    resumed = Simulation(config, tmp_path / "split").run(resume=True)
    a, b = (
        _tensors(tmp_path / "whole" / "checkpoint.safetensors"),
        _tensors(tmp_path / "split" / "checkpoint.safetensors"),
    )
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{method}: resumed weights differ in {differ[:3]}"
    assert [v["test_accuracy"] for v in whole["variants"]] == [v["test_accuracy"] for v in resumed["variants"]]
    assert whole["population_accuracy"] == resumed["population_accuracy"]
    assert whole["method"] == method and len(whole["served"]) == config.population.clients
    assert all(0 <= i < len(whole["variants"]) for i in whole["served"])
    macs = [v["macs"] for v in whole["variants"]]
    assert macs == sorted(macs)
    # every client is served the largest point within its budget (ScaleFL: level 1 below that, as the paper does)
    for budget, i in zip(whole["population"]["budgets"], whole["served"]):
        assert (macs[i] <= budget or (method == "scalefl" and i == 0)) and (i + 1 == len(macs) or macs[i + 1] > budget)


@pytest.mark.slow
def test_resume_refuses_another_methods_run(fashion_mnist_dir, tmp_path):
    Simulation(_config(fashion_mnist_dir, "heterofl", rounds=1), tmp_path).run()
    with pytest.raises(SimulationError, match=r"holds another kind of model \(heterofl\); rerun with the same options"):
        Simulation(_config(fashion_mnist_dir, "feast", rounds=1), tmp_path).run(resume=True)
    Simulation(_config(fashion_mnist_dir, "sfn", rounds=1), tmp_path / "sfn").run()
    with pytest.raises(SimulationError, match=r"other settings \(differs in: method\)"):
        Simulation(_config(fashion_mnist_dir, "dfn", rounds=1), tmp_path / "sfn").run(resume=True)


def test_unknown_method_and_bad_options_are_one_line_errors():
    with pytest.raises(MethodError, match="unknown method 'fedavgx'; choose one of: feast, centralized"):
        SimulationConfig.of(method="fedavgx")
    with pytest.raises(MethodError, match="takes no option bogus"):
        SimulationConfig.of(method="heterofl", method_options={"bogus": "1"})
    with pytest.raises(SimulationError, match="applies to --method feast only"):
        SimulationConfig.of(method="fiarse", aggregation="median")
    for name in METHODS:
        for opt in method_class(name).options.values():
            assert opt.help and "\n" not in opt.help


def test_a_required_option_that_is_missing_is_named():
    from feast_edge.sim.methods.base import Method, MethodOption

    class Needs(Method):
        name = "needs"
        options = {"k": MethodOption(int, None, "how many", required=True)}

    with pytest.raises(MethodError, match=r"--method needs needs --method-option k=\.\.\. \(how many\)"):
        Needs.parse_options({})
    with pytest.raises(MethodError, match="k='x' for needs is malformed"):
        Needs.parse_options({"k": "x"})
    assert Needs.parse_options({"k": "3"}) == {"k": 3}


@pytest.mark.slow
def test_centralized_takes_the_federations_optimizer_steps_on_pooled_data(fashion_mnist_dir, tmp_path):
    config = _config(fashion_mnist_dir, "centralized", rounds=3, batch_size=16)
    sim = Simulation(config, tmp_path)
    method, setup = sim.method, sim.setup
    sizes = dict(zip(setup.client_ids, setup.population.sizes))
    for t in range(3):
        cohort = sample_round_cohort(setup.client_ids, config.population.per_round, config.seed, t)
        assert method.round_steps(cohort) == sum(math.ceil(int(sizes[c]) / 16) for c in cohort)
    # the pooled data is every client's shard, shuffled per round (seeded by the round)
    pooled = np.sort(np.concatenate([np.asarray(s) for s in setup.population.partition.shards]))
    drawn = method.pooled_indices(0, len(pooled))
    assert np.array_equal(np.sort(drawn), pooled)
    assert not np.array_equal(drawn, method.pooled_indices(1, len(pooled)))
    longer = method.pooled_indices(0, 2 * len(pooled) + 3)
    assert len(longer) == 2 * len(pooled) + 3 and np.array_equal(np.sort(longer[: len(pooled)]), pooled)
    results = sim.run()
    seen = [r["samples"] for r in results["rounds"]]
    expected = [
        16 * method.round_steps(sample_round_cohort(setup.client_ids, config.population.per_round, config.seed, t))
        for t in range(3)
    ]
    assert seen == expected  # each round trained exactly that many batches of 16
    assert results["communication"]["routed_params_total"] == 0
