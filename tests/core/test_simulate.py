"""feast-edge simulate: the whole protocol in one process, reproducible and exactly resumable."""

from __future__ import annotations

import json

import pytest
import torch

from feast_edge.cache.variants import CacheError, cache_path, load_cache
from feast_edge.data.images import DataError
from feast_edge.run.checkpoint import load_supernet
from feast_edge.sim.setup import SimulationError
from feast_edge.sim.simulate import CHECKPOINT, Simulation
from feast_edge.space.preset import load_preset
from simconfigs import tiny_config

TINY_RUN = tiny_config(rounds=3, seed=3)


def _weights(path):
    return load_supernet(path)[0].state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, fashion_mnist_dir):
    out = tmp_path_factory.mktemp("full")
    results = Simulation(TINY_RUN, out).run()
    return out, results


@pytest.mark.slow
def test_results_cover_every_variant_and_the_population(uninterrupted):
    out, results = uninterrupted
    cached = len(load_cache(load_preset(TINY_RUN.preset)).entries)
    assert len(results["variants"]) == cached and all(0 <= v["test_accuracy"] <= 1 for v in results["variants"])
    assert [v["macs"] for v in results["variants"]] == sorted(v["macs"] for v in results["variants"])
    assert 0 <= results["population_accuracy"] <= 1
    pop = results["population"]
    assert pop["clients"] == 4 and sum(pop["shard_sizes"]) == 240 and pop["shard_size_min"] >= 10
    assert results["communication"]["reduction"] >= 1.0
    assert len(results["rounds"]) == 3 and results["rounds"][-1]["val_accuracy"] is not None
    assert json.loads((out / "results.json").read_text())["preset"] == "fmnist-tiny"
    assert (out / "variants.csv").read_text().count("\n") == 1 + cached
    assert (out / "rounds.csv").read_text().count("\n") == 4


@pytest.mark.slow
def test_resume_after_a_kill_ends_with_identical_weights(uninterrupted, tmp_path):
    full_out, full_results = uninterrupted
    assert Simulation(TINY_RUN, tmp_path).run(stop_after=2) is None  # "killed" after round 2
    assert load_supernet(tmp_path / CHECKPOINT)[1]["fields"]["round"] == 2
    resumed = Simulation(TINY_RUN, tmp_path).run(resume=True)
    a, b = _weights(full_out / CHECKPOINT), _weights(tmp_path / CHECKPOINT)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [v["test_accuracy"] for v in resumed["variants"]] == [v["test_accuracy"] for v in full_results["variants"]]


@pytest.mark.slow
def test_same_seed_same_result_other_seed_differs(uninterrupted, tmp_path):
    full_out, _ = uninterrupted
    one_round = TINY_RUN.changed(rounds=1)
    Simulation(one_round, tmp_path / "a").run(stop_after=1)
    Simulation(one_round, tmp_path / "b").run(stop_after=1)
    Simulation(one_round.changed(seed=4), tmp_path / "c").run(stop_after=1)
    a, b, c = (_weights(tmp_path / d / CHECKPOINT) for d in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
def test_resume_refuses_a_foreign_checkpoint(uninterrupted):
    full_out, _ = uninterrupted
    with pytest.raises(SimulationError, match=r"other settings \(differs in: gamma\)"):
        Simulation(TINY_RUN.changed(gamma=0.5), full_out).run(resume=True)


def test_resume_without_checkpoint(tmp_path):
    with pytest.raises(SimulationError, match="no checkpoint at"):
        Simulation(TINY_RUN, tmp_path).run(resume=True)


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"gamma": -0.5}, SimulationError, "--gamma -0.5 must be >= 0"),
        ({"per_round": 9}, SimulationError, "--per-round 9 must be between 1 and --clients"),
        ({"budget_min": 1e5}, SimulationError, "below the smallest cached variant"),  # fmnist-tiny's: 0.148M
        ({"data_dir": "/nonexistent"}, DataError, "does not exist"),
        ({"preset": "paper-cifar100"}, DataError, "choose a matching --preset"),
        ({"budgets": (1e6, 2e7)}, SimulationError, "2 budgets given for 4 clients"),
    ],
)
def test_bad_settings_are_refused(change, error, message, fashion_mnist_dir):
    with pytest.raises(error, match=message):
        Simulation(TINY_RUN.changed(**change), "/tmp/never-written")


def test_cache_of_another_preset_is_refused(tmp_path):
    with pytest.raises(CacheError, match="not 'fmnist-tiny'"):
        Simulation(TINY_RUN.changed(cache=str(cache_path(load_preset("paper-cifar100")))), tmp_path)


def test_explicit_budgets_population(tmp_path):
    budgets = (1.5e5, 5e5, 1e6, 3e6)  # fmnist-tiny's cached variants: 0.148M to 1.40M
    sim = Simulation(TINY_RUN.changed(budgets=budgets), tmp_path)
    assert tuple(sim.setup.population.budgets) == budgets
    assert sim.setup.plans["client-000"].affordable == (sim.setup.cache.smallest.arch,)


@pytest.mark.slow
def test_a_damaged_checkpoint_stops_the_resume_and_names_the_previous_one(uninterrupted, tmp_path):
    import shutil

    full_out, _ = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(full_out, out)
    previous = out / "checkpoint.prev.safetensors"
    assert previous.is_file(), "the run keeps the checkpoint before the last one"
    blob = bytearray((out / CHECKPOINT).read_bytes())
    middle = len(blob) // 2  # inside the tensor data: the header is a small part of the file
    blob[middle : middle + 16] = bytes(b ^ 0xFF for b in blob[middle : middle + 16])  # same size, other bytes
    (out / CHECKPOINT).write_bytes(bytes(blob))
    with pytest.raises(
        SimulationError,
        match=r"is corrupt.*to resume from there, run 'mv .*checkpoint\.prev\.safetensors .*checkpoint\.safetensors'",
    ):
        Simulation(TINY_RUN, out).run(resume=True)
    # Told to, the run loop resumes from the previous checkpoint and keeps the damaged file for inspection.
    loop = Simulation(TINY_RUN, out).loop
    assert loop.resume("hint", fall_back=True) == TINY_RUN.training.rounds - 1
    assert loop.recovered is not None and "resumed from the previous checkpoint" in loop.recovered
    assert len(list(out.glob("checkpoint.damaged-*.safetensors"))) == 1
    assert (
        Simulation(TINY_RUN, out).loop.resume("hint") == TINY_RUN.training.rounds - 1
    )  # the last checkpoint is a good one again
