"""Served models as versions in the simulation (feast_edge.sim.versions): the canaries across budget tiers, the
install gate on each device's held-out split, what a held version reaches, the gate off; and the data it measures
on: a test split apart from training and held-out, and a client whose class mix drifts (feast_edge.sim.growth)."""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

from feast_edge.sim.setup import SimulationError, build_setup
from feast_edge.sim.simulate import Simulation
from feast_edge.sim.versions import SimulatedVersions
from feast_edge.versions.book import OFFERED
from feast_edge.versions.canary import budget_tiers
from feast_edge.versions.gate import FIRST, INSTALLED, REFUSED, UNGATED
from simconfigs import tiny_config

SMALL, LARGE = 150_000.0, 3_750_000.0  # the tiny preset's smallest and largest budgets: two tiers
NARROW = 28  # the classifier's in-features of the tiny preset's smallest variant (every larger one uses more)


def _positions(images: torch.Tensor, pool: torch.Tensor) -> set[bytes]:
    return {bytes(x.numpy().tobytes()) for x in images} & {bytes(x.numpy().tobytes()) for x in pool}


def test_the_test_split_is_apart_from_training_and_held_out_and_nothing_changes_without_it() -> None:
    plain = build_setup(tiny_config(holdout=0.2, validate_on="devices"))
    split = build_setup(tiny_config(holdout=0.2, validate_on="devices", test_split=0.25))
    for client in plain.client_ids:
        train, held = split.client_data(client), split.client_holdout(client)
        test = split.client_test(client)
        assert test[1].numel() > 0 and plain.client_test(client)[1].numel() == 0
        sizes = len(train[1]) + len(held[1]) + len(test[1])
        assert sizes == len(plain.client_data(client)[1]) + len(plain.client_holdout(client)[1])
        assert not _positions(test[0], train[0]) and not _positions(test[0], held[0])
    # without a test split, the training and held-out examples are exactly what they were
    again = build_setup(tiny_config(holdout=0.2, validate_on="devices"))
    for client in plain.client_ids:
        assert torch.equal(plain.client_data(client)[0], again.client_data(client)[0])
        assert torch.equal(plain.client_holdout(client)[1], again.client_holdout(client)[1])
    assert "test_split" not in tiny_config().decisive() and "test_split" in tiny_config(test_split=0.1).decisive()


def test_a_drifting_client_gains_its_images_class_after_class_and_holds_out_only_the_classes_it_holds() -> None:
    config = tiny_config(
        holdout=0.2, validate_on="devices", test_split=0.2, shard_start=0.2, shard_growth=0.2, drift_clients=1
    )
    setup = build_setup(config)
    (client,) = setup.growth.drifting
    index = setup.client_ids.index(client)
    order = setup.growth.class_order(index, int(setup.client_data(client)[1].max()) + 1).tolist()
    rank = {c: order.index(c) for c in order}
    seen = []
    for t in range(5):
        labels = setup.client_data(client, t)[1]
        classes = sorted({int(c) for c in labels}, key=rank.get)
        # a prefix of its class order (the last one partly): every class before the newest is complete
        assert [rank[c] for c in classes] == sorted(rank[c] for c in classes)
        seen.append(classes)
        assert set(setup.client_holdout(client, t)[1].tolist()) <= set(classes)
        assert set(setup.client_test(client, t)[1].tolist()) <= set(classes)
    assert len(seen[0]) < len(seen[-1])  # its mix drifted: new classes came
    assert all(a == b[: len(a)] for a, b in pairwise(seen))
    other = next(c for c in setup.client_ids if c != client)
    assert torch.equal(setup.client_holdout(other, 0)[1], setup.client_holdout(other)[1])  # the others stay whole
    with pytest.raises(SimulationError, match="--drift-clients"):
        tiny_config(drift_clients=1)  # nothing grows, so nothing drifts


def test_versions_need_devices_that_validate() -> None:
    with pytest.raises(SimulationError, match="--versions"):
        tiny_config(versions=True)
    assert "canary" not in tiny_config(versions=True, validate_on="devices", holdout=0.2).decisive()


@pytest.fixture(scope="module")
def trained() -> SimpleNamespace:
    """Four clients in two budget tiers, one joining at step 2, after a few continuous rounds validated by devices."""
    config = tiny_config(
        clients=4, per_round=3, rounds=4, eval_every=1, continuous=True, validate_on="devices", holdout=0.3,
        test_split=0.2, train_limit=1200, budgets=(SMALL, SMALL, LARGE, LARGE), versions=True, canary=0.25,
        joined_at_start=0.75, join_rounds=2, shard_start=0.6, shard_growth=0.2,
    )  # fmt: skip
    return SimpleNamespace(config=config, setup=build_setup(config))


def test_a_continuous_simulation_adds_a_version_at_each_served_change_with_canaries_in_every_tier(
    trained: SimpleNamespace, tmp_path
) -> None:
    sim = Simulation(trained.config, tmp_path, setup=trained.setup)
    changes = []
    sim.loop.run(on_round=lambda r: changes.append(sim.best.get("round")), stop_after=4)
    fleet = sim.environment.versions
    assert (tmp_path / "versions.sqlite").is_file()
    versions = fleet.book.versions()
    assert len(versions) == len({r for r in changes if r is not None}) >= 2
    for version in versions:
        present = fleet.present(version.round - 1)
        tiers = budget_tiers({d: fleet.budgets[d] for d in present})
        assert {tiers[d] for d in version.canaries} == set(tiers.values())
        events = fleet.book.events(version=version.number)
        offered = [e.device for e in events if e.event == OFFERED]
        assert sorted(offered) == sorted(set(offered))  # one offer per device
        assert {e.device for e in events if e.event != OFFERED} == set(offered)  # each answered
    first = fleet.book.answers(1)
    assert {e.event for e in first.values()} == {FIRST}
    assert set(fleet.running) == set(fleet.present(versions[-1].round - 1))


def _record(round_: int) -> SimpleNamespace:
    return SimpleNamespace(round=round_, clock=float(round_), validation={}, average_of=None, val_accuracy=None)


def _fleet(sim: SimpleNamespace, model: torch.nn.Module, gated: bool = True) -> SimulatedVersions:
    setup = sim.setup
    budgets = {c: float(b) for c, b in zip(setup.client_ids, setup.population.budgets)}
    return SimulatedVersions(setup, model, budgets, canary=0.25, gated=gated, seed=0, calibration=50)


def _trained_model(sim: SimpleNamespace, tmp_path) -> torch.nn.Module:
    run = Simulation(sim.config.changed(versions=False), tmp_path, setup=sim.setup)
    run.loop.run(stop_after=4)
    return run.model


def _worse(model: torch.nn.Module, columns: slice) -> torch.nn.Module:
    """``model`` with noise on the classifier's in-features ``columns`` (variants that use them fail)."""
    import copy

    worse = copy.deepcopy(model)
    with torch.no_grad():
        weight = worse.state_dict()["classifier.weight"]
        weight[:, columns] += 50 * torch.randn(weight[:, columns].shape, generator=torch.Generator().manual_seed(0))
    return worse


def test_a_version_worse_on_some_devices_is_refused_there_and_installed_elsewhere(trained, tmp_path) -> None:
    model = _trained_model(trained, tmp_path)
    fleet = _fleet(trained, model)
    fleet.served(_record(1))  # step 0: the three present devices install their first model
    assert {e.event for e in fleet.book.answers(1).values()} == {FIRST}
    fleet.model = _worse(model, slice(NARROW, None))  # only the large tier's variant fails
    fleet.served(_record(2))
    answers = fleet.book.answers(2)
    assert fleet.book.version(2).state == "promoted"  # one regressed canary of two is no majority
    for device, event in answers.items():
        assert event.event == (REFUSED if fleet.budgets[device] == LARGE else INSTALLED), (device, event.reason)
        assert fleet.running[device].version == (1 if fleet.budgets[device] == LARGE else 2)


def test_a_held_version_goes_only_to_devices_that_run_none_and_the_gate_off_installs_everything(
    trained, tmp_path
) -> None:
    model = _trained_model(trained, tmp_path)
    for gated in (True, False):
        fleet = _fleet(trained, model, gated)
        fleet.served(_record(1))
        joiner = next(d for d in fleet.present(2) if d not in fleet.present(0))
        fleet.model = _worse(model, slice(None))  # every variant fails
        fleet.served(_record(3))  # step 2: the fourth device has joined and runs nothing
        version, answers = fleet.book.version(2), fleet.book.answers(2)
        if gated:
            assert version.state == "held"
            assert set(answers) == set(version.canaries) | {joiner}
            assert answers[joiner].event == FIRST
            assert all(answers[c].event == REFUSED for c in version.canaries if c != joiner)
        else:
            assert version.state == "direct" and set(answers) == set(fleet.present(2))
            assert {e.event for d, e in answers.items() if d != joiner} == {UNGATED}
            assert all(fleet.running[d].version == 2 for d in fleet.present(2))


def test_a_lying_validator_reports_each_version_a_regression_and_keeps_its_model(trained, tmp_path) -> None:
    model = _trained_model(trained, tmp_path)
    fleet = _fleet(trained, model)
    fleet.liars = frozenset({fleet.present(0)[0]})
    fleet.served(_record(1))
    fleet.served(_record(2))
    (liar,) = fleet.liars
    event = fleet.book.answers(2)[liar]
    assert event.event == REFUSED and event.figures["new_correct"] == 0 and fleet.running[liar].version == 1
