"""Clients that join over time and shards that grow (feast_edge.sim.growth): the stated, seeded schedule; a cohort
only of clients that have joined; training only on the examples a client holds, never on its held-out ones."""

from __future__ import annotations

import csv
import dataclasses
import re

import pytest
import torch

from feast_edge.run.checkpoint import load_supernet
from feast_edge.sim.config import OVER_TIME
from feast_edge.sim.growth import Growth, join_steps
from feast_edge.sim.setup import SimulationConfig, SimulationError, build_setup
from feast_edge.sim.simulate import CHECKPOINT, Simulation
from simconfigs import cli_options, tiny_config

IDS = [f"client-{i:03d}" for i in range(10)]
GROWING = dict(
    clients=6, per_round=3, joined_at_start=0.34, join_rounds=3, shard_start=0.5, shard_growth=0.25, eval_every=2
)


def _growth(seed: int = 0, **changes) -> Growth:
    population = SimulationConfig.of(**{"clients": 10, **GROWING, **changes}).population
    return Growth.of(population, IDS, [20] * 10, seed)


def test_a_share_of_the_clients_starts_and_the_rest_join_evenly_over_the_join_rounds() -> None:
    joined = join_steps(IDS, 0.3, 7, seed=0)
    steps = sorted(joined.values())
    assert steps == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]  # N0 = ⌈0.3 · 10⌉; a_k = ⌈(k + 1) · 7 / 7⌉
    assert sorted(join_steps(IDS, 0.3, 3, seed=0).values()) == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]  # ⌈(k + 1) · 3 / 7⌉
    assert sorted(join_steps(IDS, 0.01, 2, seed=0).values())[:2] == [0, 1]  # at least one client from the start


def test_arrivals_and_reveals_are_seeded_the_same_seed_the_same_another_seed_not() -> None:
    assert join_steps(IDS, 0.3, 7, seed=4) == join_steps(IDS, 0.3, 7, seed=4)
    assert join_steps(IDS, 0.3, 7, seed=4) != join_steps(IDS, 0.3, 7, seed=5)
    same, other = _growth(seed=4), _growth(seed=5)
    assert torch.equal(same.revealed("client-003", 3, 0), _growth(seed=4).revealed("client-003", 3, 0))
    assert not torch.equal(same.revealed("client-003", 3, 0), other.revealed("client-003", 3, 0))


def test_a_shard_grows_by_its_rule_from_its_join_and_only_ever_adds_examples() -> None:
    growth = Growth({"a": 2}, {"a": 20}, shard_start=0.25, shard_growth=0.1, seed=0)
    # v(t) = max(1, ⌈20 · min(1, 0.25 + 0.1 · max(0, t - 2))⌉): its start until it joins, then 2 more a step, then all
    assert [growth.visible("a", t) for t in range(13)] == [5, 5, 5, 7, 9, 11, 13, 15, 17, 19, 20, 20, 20]
    held = [set(growth.revealed("a", 0, t).tolist()) for t in range(13)]
    assert all(before <= after for before, after in zip(held, held[1:]))
    assert torch.equal(growth.revealed("a", 0, 12), torch.arange(20))  # a whole shard: every example, in shard order
    assert Growth({"a": 0}, {"a": 3}, 0.01, 0.0, 0).visible("a", 5) == 1  # never an empty shard


def test_the_settings_enter_the_fingerprint_only_away_from_their_defaults() -> None:
    plain = SimulationConfig.of()
    assert not plain.population.over_time and not set(OVER_TIME) & set(plain.decisive())
    growing = SimulationConfig.of(shard_start=0.5)
    assert set(OVER_TIME) <= set(growing.decisive()) and growing.fingerprint() != plain.fingerprint()
    assert SimulationConfig.of(joined_at_start=0.5, join_rounds=4).fingerprint() != growing.fingerprint()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(joined_at_start=0.5), "--join-rounds"),
        (dict(join_rounds=3), "--joined-at-start below 1"),
        (dict(joined_at_start=0.0, join_rounds=3), "--joined-at-start 0.0 must be a share"),
        (dict(shard_growth=0.1), "--shard-start below 1"),
        (dict(shard_start=0.0), "--shard-start 0.0 must be a share"),
        (dict(shard_start=0.5, method="centralized"), "--method centralized"),
        (
            dict(joined_at_start=0.2, join_rounds=4, mode="async", buffer=5, concurrency=10),
            "the 4 clients present at the first release cannot fill --buffer 5",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_option(change, message) -> None:
    with pytest.raises(SimulationError) as caught:
        SimulationConfig.of(**change)
    assert message in str(caught.value)


def test_at_the_defaults_the_setup_builds_no_growth_and_a_client_trains_its_whole_shard(fashion_mnist_dir) -> None:
    setup = build_setup(tiny_config())
    assert setup.growth is None
    images, labels = setup.client_data("client-001")
    assert all(torch.equal(a, b) for a, b in zip(setup.client_data("client-001", 7), (images, labels)))


def _numbered(setup) -> None:
    """Each training image carries its row in the data set in its first three pixels (the test reads them back)."""
    images = setup.train_set.images.clone()
    rows = torch.arange(len(images))
    for byte in range(3):
        images[:, 0, 0, byte] = (rows >> (8 * byte)) % 256
    setup.train_set = dataclasses.replace(setup.train_set, images=images)


def _rows(images: torch.Tensor) -> set[int]:
    pixels = images[:, 0, 0, :3].long()
    return set((pixels[:, 0] + (pixels[:, 1] << 8) + (pixels[:, 2] << 16)).tolist())


def test_a_cohort_holds_only_joined_clients_training_only_what_they_hold_never_their_held_out_examples(
    fashion_mnist_dir, tmp_path
) -> None:
    # validated by the clients' held-out splits, at the last round only (the run stops before: tested in the resume)
    config = tiny_config(rounds=5, holdout=0.2, validate_on="devices", **{**GROWING, "eval_every": 5})
    setup = build_setup(config)
    _numbered(setup)
    sim = Simulation(config, tmp_path, setup=setup)
    trained: list[tuple[int, str, set[int]]] = []
    train_client = sim.method.train_client

    def recording(t, client, plan, delivered, images, labels, lr, seed):
        trained.append((t, client, _rows(images)))
        return train_client(t, client, plan, delivered, images, labels, lr, seed)

    sim.method.train_client = recording
    assert sim.run(stop_after=4) is None
    growth = setup.growth
    assert growth is not None and sorted(growth.joined.values()) == [0, 0, 0, 1, 2, 3]
    for t, client, rows in trained:
        assert growth.joined[client] <= t, f"{client} trained in round {t + 1} before joining"
        assert len(rows) == growth.visible(client, t)
        assert not rows & _rows(setup.client_holdout(client)[0]), f"{client}'s held-out examples trained"
        assert rows <= _rows(setup.client_data(client)[0])
    for client in growth.joined:  # what a client held, it still holds
        held = [rows for _, c, rows in sorted(trained, key=lambda x: x[0]) if c == client]
        assert all(before <= after for before, after in zip(held, held[1:]))
    history = sim.history
    assert [h.present for h in history] == [growth.counts(t)[0] for t in range(4)] == [3, 4, 5, 6]
    assert [h.visible for h in history] == [growth.counts(t)[1] for t in range(4)]
    assert all(h.samples == sum(growth.visible(c, h.round - 1) for c in h.updated) for h in history)
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    assert [int(r["present"]) for r in rows] == [3, 4, 5, 6]


def test_asynchronous_releases_draw_only_clients_that_have_joined(fashion_mnist_dir, tmp_path) -> None:
    config = tiny_config(rounds=5, mode="async", buffer=2, concurrency=3, clock="uniform", **GROWING)
    sim = Simulation(config, tmp_path)
    assert sim.run(stop_after=4) is None
    joined = sim.setup.growth.joined
    for h in sim.history:
        for client in h.updated:  # trained from release round - 1 - staleness, when it had joined
            assert joined[client] <= h.round - 1 - h.staleness.get(client, 0)
    assert {c for h in sim.history for c in h.updated} - {c for c, a in joined.items() if a == 0}


@pytest.mark.slow
def test_a_growing_run_resumes_to_the_weights_and_records_of_an_uninterrupted_one(fashion_mnist_dir, tmp_path) -> None:
    config = tiny_config(rounds=5, holdout=0.2, validate_on="devices", **GROWING)  # BN of what each holds at round t
    full = Simulation(config, tmp_path / "full")
    full.run(stop_after=4)
    assert Simulation(config, tmp_path / "cut").run(stop_after=2) is None
    resumed = Simulation(config, tmp_path / "cut")
    resumed.run(resume=True, stop_after=4)
    a, b = (load_supernet(tmp_path / d / CHECKPOINT)[0].state_dict() for d in ("full", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    keys = ("cohort", "present", "visible", "samples", "val_accuracy")
    assert [[getattr(h, k) for k in keys] for h in resumed.history] == [
        [getattr(h, k) for k in keys] for h in full.history
    ]


@pytest.mark.slow
def test_a_growing_population_spread_over_two_processes_trains_the_weights_of_one(cli, fashion_mnist_dir, tmp_path):
    options = [*cli_options(tiny_config(clients=6, per_round=4, rounds=3)), "--threads", "1"]
    options += ["--joined-at-start", "0.34", "--join-rounds", "2", "--shard-start", "0.5", "--shard-growth", "0.25"]
    runs = [tmp_path / "one", tmp_path / "two"]
    for out, nproc in zip(runs, ("1", "2")):
        result = cli.run("simulate", *options, "--out", str(out), "--nproc", nproc)
        assert result.returncode == 0, result.stderr + result.stdout[-2000:]
        assert re.search(r"round 1/3 .* 3 clients, \d+ examples", result.stdout)  # the round line says them
    a, b = (load_supernet(out / CHECKPOINT)[0].state_dict() for out in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [[(r["present"], r["visible"]) for r in csv.DictReader((out / "rounds.csv").open())] for out in runs]
    assert rows[0] == rows[1] and [p for p, _ in rows[0]] == ["3", "4", "6"]
