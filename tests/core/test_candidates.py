"""A validated round's two candidates, its own weights and the tail mean, compared on the same held-out examples
(feast_edge.evaluate.candidates), then judged against the incumbent (feast_edge.evaluate.served_round.serve_after);
and a simulation that serves the one its devices' figures choose, with both steps in its record and reason."""

from __future__ import annotations

import pytest
import torch

from feast_edge.evaluate.candidates import MEAN, OWN, choose_candidate, on_devices, on_server
from feast_edge.evaluate.served_round import Figure, serve_after
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.round_record import RoundRecord
from feast_edge.run.store import BEST, CHECKPOINT, PREVIOUS
from feast_edge.sim.device_validation import InProcessValidation
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config

SPAN = (5, 6)


def _figures(rates: dict[str, float], total: int = 200, variant: str = "variant 3") -> dict[str, Figure]:
    return {d: Figure(variant, round(rate * total), total) for d, rate in rates.items()}


def test_the_mean_is_offered_where_the_devices_paired_figures_favour_it_and_the_round_own_weights_otherwise() -> None:
    own = _figures({"a": 0.80, "b": 0.70, "c": 0.60})
    better = on_devices(6, SPAN, own, _figures({"a": 0.82, "b": 0.71, "c": 0.61}))
    assert better.candidate == MEAN and better.voters == ("a", "b", "c")
    assert better.reason == (
        "the mean of rounds 5-6's weights: own 70.0% vs the mean of rounds 5-6 71.3%, paired over 3 device(s)"
    )
    worse = on_devices(6, SPAN, own, _figures({"a": 0.78, "b": 0.69, "c": 0.60}))
    assert worse.candidate == OWN and worse.reason.startswith("round 6's own weights: own 70.0% vs the mean")
    assert on_devices(6, SPAN, own, dict(own)).candidate == OWN  # a tie: the round's own weights


def test_one_liar_beside_two_honest_devices_cannot_choose() -> None:
    own = _figures({"a": 0.80, "b": 0.70, "liar": 0.50})
    # Both honest devices score the round's own weights higher; the liar claims the mean is 50 points better.
    lying = on_devices(6, SPAN, own, _figures({"a": 0.79, "b": 0.68, "liar": 1.0}))
    assert lying.candidate == OWN
    assert (
        "; liar's difference +50.0 points bounded to -1.0 by the others' (one device alone cannot choose)"
        in lying.reason
    )
    # The other way round: the honest devices favour the mean, the liar claims it lost everything.
    other = on_devices(6, SPAN, own, _figures({"a": 0.82, "b": 0.71, "liar": 0.0}))
    assert other.candidate == MEAN
    # Without the bound the liar's claim would outweigh both honest devices: the raw mean difference.
    assert (1.0 - 0.5) + (0.79 - 0.80) + (0.68 - 0.70) > 0


def test_distrusted_devices_and_unpaired_figures_do_not_vote() -> None:
    own = _figures({"a": 0.80, "b": 0.70, "old": 0.60})
    mean = {**_figures({"a": 0.79, "b": 0.99}), "b": Figure("variant 3", 150, 150)}  # b: other examples
    choice = on_devices(6, SPAN, own, mean, distrusted={"a"})
    assert choice.candidate == OWN and choice.voters == ()
    assert choice.reason == (
        "round 6's own weights (no device tested both it and the mean of rounds 5-6 on the same examples; 1 device(s) "
        "tested only the round's own weights)"
    )
    other_variant = {"a": Figure("variant 2", 190, 200)}
    assert on_devices(6, SPAN, own, other_variant).voters == ()


def test_on_the_servers_split_the_higher_score_is_offered_and_a_tie_keeps_the_rounds_own_weights() -> None:
    assert on_server(20, (16, 20), 0.71, 0.72).candidate == MEAN
    assert on_server(20, (16, 20), 0.71, 0.71).candidate == OWN
    assert on_server(20, (16, 20), 0.71, 0.70).reason == (
        "round 20's own weights: own 71.00% vs the mean of rounds 16-20 70.00% on the server's validation split"
    )
    assert on_server(20, (16, 20), 0.71, None).candidate == OWN


def _validation(rates: dict[str, float]) -> dict:
    return {"source": "devices", "served": {d: [f.variant, f.correct, f.total] for d, f in _figures(rates).items()}}


def _record(round_: int, own: dict[str, float], mean: dict[str, float] | None = None) -> RoundRecord:
    record = RoundRecord(round=round_, lr=0.1, cohort=sorted(own), validation=_validation(own))
    record.val_accuracy = sum(own.values()) / len(own)
    if mean is not None:
        record.candidates = {
            "of": [round_ - 1, round_],
            "mean": {"val_accuracy": sum(mean.values()) / len(mean), "validation": _validation(mean)},
        }
    return record


def test_a_chosen_mean_becomes_the_rounds_figure_and_both_steps_make_the_served_reason() -> None:
    first = _record(4, {"a": 0.70, "b": 0.60, "c": 0.50})
    best, _ = serve_after({}, [first], first)
    last = _record(6, {"a": 0.72, "b": 0.62, "c": 0.52}, mean={"a": 0.75, "b": 0.64, "c": 0.55})
    history = [first, last]
    choice = choose_candidate(history, last)
    assert choice is not None and choice.candidate == MEAN and choose_candidate(history, last) is None  # once
    assert last.average_of == [5, 6] and last.validation["served"]["a"] == ["variant 3", 150, 200]
    assert last.candidates["choice"] == MEAN and last.candidates["own"]["validation"]["served"]["a"][1] == 144
    best, now = serve_after(best, history, last)
    assert now and best["round"] == 6 and best["average_of"] == [5, 6]
    assert best["reason"] == (
        "the mean of rounds 5-6's weights: own 62.0% vs the mean of rounds 5-6 64.7%, paired over 3 device(s); "
        "round 6: the newest validated round, no significant regression against round 4 on the served variants of "
        "3 device(s)"
    )


def test_a_candidate_that_regressed_keeps_the_incumbent_and_the_reason_names_what_the_round_offered() -> None:
    first = _record(4, {"a": 0.90, "b": 0.90, "c": 0.90})
    best, _ = serve_after({}, [first], first)
    last = _record(6, {"a": 0.50, "b": 0.50, "c": 0.50}, mean={"a": 0.40, "b": 0.40, "c": 0.40})
    choose_candidate([first, last], last)
    best, now = serve_after(best, [first, last], last)
    assert not now and best["round"] == 4 and "average_of" not in best and last.average_of is None
    assert best["reason"].startswith("round 4 kept: round 6 regressed on the served variants of 3 of 3 device(s)")
    assert best["reason"].endswith(
        "(round 6's candidate: round 6's own weights: own 50.0% vs the mean of rounds 5-6 40.0%, paired over 3 device(s))"
    )


@pytest.mark.slow
@pytest.mark.parametrize("favoured", [MEAN, OWN])
def test_a_simulation_serves_the_candidate_its_devices_figures_favour_and_a_resumed_run_the_same(
    tmp_path, fashion_mnist_dir, monkeypatch: pytest.MonkeyPatch, favoured: str
) -> None:
    """The devices' figures are what decides: every client reports every held-out example of the favoured candidate
    right (the weights, the cohort and the other candidate's figures are the run's own)."""
    validate = InProcessValidation.__call__

    def reported(self, t, record, alternative=None):
        figure = validate(self, t, record, alternative)
        if alternative is not None:
            tested = record.validation if favoured == OWN else record.candidates["mean"]["validation"]
            for served in tested["served"].values():
                served[1] = served[2]
        return figure

    monkeypatch.setattr(InProcessValidation, "__call__", reported)
    config = tiny_config(
        fashion_mnist_dir, rounds=3, eval_every=1, validate_on="devices", holdout=0.2, per_round=4, serve_average=2
    )
    full = Simulation(config, tmp_path / "full").run()
    last = full["rounds"][-1]
    assert last["candidates"]["of"] == [2, 3] and last["candidates"]["choice"] == favoured
    assert len(last["candidates"]["voters"]) == 4
    best, final, before = (load_supernet(tmp_path / "full" / f)[0].state_dict() for f in (BEST, CHECKPOINT, PREVIOUS))
    assert full["served_round"]["round"] == 3
    words = "the mean of rounds 2-3's weights" if favoured == MEAN else "round 3's own weights"
    assert full["served_round"]["reason"].startswith(f"{words}: own ")
    for name, tensor in best.items():
        if tensor.is_floating_point():
            expected = (before[name] + final[name]) / 2 if favoured == MEAN else final[name]
            assert torch.allclose(tensor, expected, atol=1e-6), name
    Simulation(config, tmp_path / "resumed").run(stop_after=2)
    resumed = Simulation(config, tmp_path / "resumed").run(resume=True)
    assert resumed["served_round"] == full["served_round"]
    again = load_supernet(tmp_path / "resumed" / BEST)[0].state_dict()
    assert all(torch.equal(best[k], again[k]) for k in best)


@pytest.mark.slow
def test_asynchronous_releases_offer_the_last_release_or_the_mean_of_the_last_releases_alike(
    tmp_path, fashion_mnist_dir
) -> None:
    config = tiny_config(
        fashion_mnist_dir, rounds=4, eval_every=4, validate_on="devices", holdout=0.2, mode="async", buffer=2,
        concurrency=3, serve_average=2,
    )  # fmt: skip
    results = Simulation(config, tmp_path / "async").run()
    last = results["rounds"][-1]
    candidates = last["candidates"]
    assert candidates["of"] == [3, 4] and candidates["voters"] and candidates["choice"] in (MEAN, OWN)
    own, mean = (candidates[c]["validation"]["served"] for c in (OWN, MEAN))
    assert own.keys() == mean.keys() and all(own[d][2] == mean[d][2] for d in own)  # the same examples
    assert results["served_round"]["reason"].startswith(candidates["reason"])
    assert (results["served_round"].get("average_of") == [3, 4]) == (candidates["choice"] == MEAN)
