"""The served round of a server without data (feast_edge.evaluate.served_round) and the disagreement flags that tell
a device with other classes from one whose report may be false (feast_edge.evaluate.federated.disagreements)."""

from __future__ import annotations

import itertools

from feast_edge.evaluate.federated import accuracy_range, class_distance, disagreements, robust_validation
from feast_edge.evaluate.served_round import served_record, served_round

N = 400  # held-out examples per device: 2 standard errors of a difference near 80 % are about 5.7 points


def _validation(figures: dict[str, float], flagged: tuple[str, ...] = (), n: int = N) -> dict:
    """A round's validation record: each device's accuracy on its served variant (variant 3 for all)."""
    return {
        "source": "devices",
        "served": {d: ["variant 3", round(a * n), n] for d, a in figures.items()},
        "flagged": {d: "far from the others" for d in flagged},
    }


def test_the_first_validation_is_served_then_each_newer_round_without_a_regression() -> None:
    history = [(5, _validation({"a": 0.5, "b": 0.6, "c": 0.55})), (10, _validation({"a": 0.7, "b": 0.72, "c": 0.7}))]
    assert served_round(history[:1]).round == 5
    choice = served_round(history)
    assert choice.round == 10
    assert "newest validated round" in choice.reason and "3 device(s)" in choice.reason


def test_a_later_round_that_regressed_on_most_devices_served_variants_keeps_the_earlier_one() -> None:
    history = [(5, _validation({"a": 0.8, "b": 0.8, "c": 0.8})), (10, _validation({"a": 0.6, "b": 0.65, "c": 0.81}))]
    choice = served_round(history)
    assert choice.round == 5
    assert choice.regressed == ("a", "b")
    assert "round 5 kept: round 10 regressed on the served variants of 2 of 3 device(s)" in choice.reason
    # ... and a third validation is compared with the served round, not with the regressed one.
    later = served_round([*history, (15, _validation({"a": 0.79, "b": 0.8, "c": 0.8}))])
    assert later.round == 15


def test_a_fall_the_held_out_split_cannot_tell_from_noise_does_not_count() -> None:
    history = [
        (5, _validation({"a": 0.8, "b": 0.8, "c": 0.8}, n=50)),
        (10, _validation({"a": 0.72, "b": 0.7, "c": 0.8}, n=50)),
    ]
    assert served_round(history).round == 10  # 8-10 points on 50 examples is within two standard errors


def test_one_liar_reporting_100_then_0_is_distrusted_named_and_cannot_roll_the_fleet_back() -> None:
    history = [
        (1, _validation({"ann": 0.2, "bob": 0.25, "mallory": 1.0}, flagged=("mallory",))),
        (2, _validation({"ann": 0.35, "bob": 0.4, "mallory": 0.0})),
        (3, _validation({"ann": 0.45, "bob": 0.5, "mallory": 0.0})),
    ]
    choice = served_round(history)
    assert choice.round == 3
    assert set(choice.distrusted) == {"mallory"}
    assert choice.distrusted["mallory"].startswith("round 2: its held-out accuracy went 100.0% -> 0.0%")


def test_a_liar_whose_100_percent_its_classes_could_explain_is_distrusted_once_its_0_percent_is_flagged() -> None:
    # Its first 100 % was not flagged (its class mix allowed it); its fall came first, the flag later.
    history = [
        (1, _validation({"ann": 0.2, "bob": 0.25, "mallory": 1.0})),
        (2, _validation({"ann": 0.35, "bob": 0.4, "mallory": 0.0})),
        (3, _validation({"ann": 0.45, "bob": 0.5, "mallory": 0.0})),
    ]
    assert served_round(history).distrusted == {}  # never flagged: one vote of three
    flagged = [*history, (4, _validation({"ann": 0.6, "bob": 0.7, "mallory": 0.0}, flagged=("mallory",)))]
    choice = served_round(flagged)
    assert set(choice.distrusted) == {"mallory"}
    assert choice.distrusted["mallory"].startswith(
        "round 4: its held-out accuracy went 100.0% -> 0.0% (round 1 -> 2) while the other devices' moved +15.0 points"
    )


def test_a_plausible_liar_favouring_an_early_round_is_one_vote_of_three() -> None:
    # In the honest range (not flagged), high in round 5 and low afterwards: it votes "regressed" every time.
    history = [
        (5, _validation({"ann": 0.6, "bob": 0.7, "mallory": 0.7})),
        (10, _validation({"ann": 0.75, "bob": 0.8, "mallory": 0.6})),
        (15, _validation({"ann": 0.8, "bob": 0.82, "mallory": 0.6})),
    ]
    at_10 = served_round(history[:2])
    assert at_10.round == 10 and at_10.distrusted == {}
    assert at_10.regressed == ("mallory",) and "regressed on 1 of 3 only (mallory 70.0% -> 60.0%)" in at_10.reason
    assert served_round(history).round == 15


def test_an_honest_device_that_moves_against_the_trend_but_is_not_flagged_keeps_its_vote() -> None:
    history = [
        (5, _validation({"a": 0.3, "b": 0.3, "c": 0.3})),
        (10, _validation({"a": 0.8, "b": 0.35, "c": 0.32})),  # a's jump is far from the others' trend
        (15, _validation({"a": 0.4, "b": 0.34, "c": 0.3})),
    ]
    assert served_round(history).distrusted == {}
    # Its classes explain its gap later ("differs", not "flagged"): still one vote.
    differs = {**_validation({"a": 0.9, "b": 0.4, "c": 0.35}), "differs": {"a": "its classes differ: it holds 7 of 10"}}
    assert served_round([*history, (20, differs)]).distrusted == {}


def test_without_served_figures_nothing_is_chosen_and_the_record_names_the_last_round() -> None:
    assert served_round([(5, {"source": "devices"})]).round is None
    assert served_record(20, {}) == {
        "round": 20,
        "of": 20,
        "reason": "round 20: the last round (no validation chose another)",
    }
    record = served_record(20, {"round": 15, "reason": "round 15 kept: ..."})
    assert record == {"round": 15, "of": 20, "reason": "round 15 kept: ..."}


def test_class_distance_bounds_the_accuracy_gap_of_any_model_between_two_mixes() -> None:
    per_class = [1.0, 0.0, 0.5]
    mine, theirs = [10, 0, 10], [5, 10, 5]
    gap = abs(sum(a * n for a, n in zip(per_class, mine)) / 20 - sum(a * n for a, n in zip(per_class, theirs)) / 20)
    assert gap <= class_distance(mine, theirs) + 1e-12
    assert class_distance(mine, mine) == 0.0


def test_a_device_whose_classes_explain_its_gap_is_said_to_differ_not_to_lie() -> None:
    # dana holds 3 of 10 classes; the others, all 10 at 30 %: the same model could be right on all of dana's classes
    # (3 classes' worth of accuracy is 30 % of ten), so her 70 % is explained.
    reports = {"ann": [(300, 1000)], "bob": [(320, 1000)], "cat": [(280, 1000)], "dana": [(700, 1000)]}
    mixes = {d: [10] * 10 for d in ("ann", "bob", "cat")} | {"dana": [0] * 7 + [10] * 3}
    flagged, differs = disagreements(reports, 1, mixes)
    assert flagged == {}
    assert differs["dana"].startswith("its classes differ: it holds 3 of 10 (its held-out accuracy 70.0%")
    # With 5 of 10 (total-variation distance 0.5, more than her 40 points), a model at 30 % on ann's ten classes is at
    # most 60 % on dana's five: 70 % is more than her classes and 1,000 examples' noise explain.
    five = {**mixes, "dana": [0] * 5 + [10] * 5}
    assert abs(class_distance(five["dana"], five["ann"]) - 0.5) < 1e-12
    flagged, _ = disagreements(reports, 1, five)
    assert "its class mix cannot explain the gap" in flagged["dana"]


def test_accuracy_range_is_the_least_and_most_a_model_can_score_on_one_mix_given_its_score_on_another() -> None:
    # Brute force over per-class accuracies in steps of 1/4: every model's pair (score on other, score on mix) lies in
    # the range; at 0 % and 100 % on the other mix its ends are worked out by hand.
    mix, other = [3, 1, 0, 2], [1, 2, 3, 0]
    p, q = [x / 6 for x in mix], [y / 6 for y in other]
    grid = [i / 4 for i in range(5)]
    seen: dict[float, list[float]] = {}
    for a in itertools.product(grid, repeat=4):
        on_other = round(sum(qk * ak for qk, ak in zip(q, a)), 9)
        seen.setdefault(on_other, []).append(sum(pk * ak for pk, ak in zip(p, a)))
    for on_other, scores in seen.items():
        low, high = accuracy_range(mix, other, on_other)
        assert low - 1e-6 <= min(scores) and max(scores) <= high + 1e-6
    low, high = accuracy_range(mix, other, 0.0)
    assert low == 0.0 and abs(high - 2 / 6) < 1e-12  # only class 3 is free of the other's classes
    low, high = accuracy_range(mix, other, 1.0)
    assert abs(low - 4 / 6) < 1e-12 and high == 1.0
    assert accuracy_range(mix, [0, 0, 0, 0], 0.5) == (0.0, 1.0)  # no mix to compare: anything goes


def test_a_liar_beside_two_honest_devices_cannot_get_an_honest_one_called_false() -> None:
    # The label-skewed fleet of bench/bench_served_round.py: a holds classes 0-3, b 2-7, c 0, 1 and 5-9; b lies (0 %).
    # Against the median of the two others (b's 0 % and a's 35.8 %), c's 87.3 % is 69 points off; against a alone, the
    # class mixes (distance 0.71) explain the 52 points between them.
    mixes = {
        "a": [25] * 4 + [0] * 6,
        "b": [0, 0] + [25] * 6 + [0, 0],
        "c": [25, 25, 0, 0, 0] + [25] * 5,
    }
    reports = {"a": [(43, 120)], "b": [(0, 150)], "c": [(157, 180)]}
    flagged, differs = disagreements(reports, 1, mixes)
    assert "c" not in flagged and differs["c"].startswith("its classes differ: it holds 7 of 10")


def test_a_gap_the_class_mix_cannot_explain_is_flagged_as_possibly_false() -> None:
    reports = {"ann": [(30, 100)], "bob": [(32, 100)], "cat": [(28, 100)], "mallory": [(100, 100)]}
    mixes = {d: [10] * 10 for d in reports}
    result = robust_validation(reports, 1, mixes=mixes)
    assert result.differs == {}
    assert "its class mix cannot explain the gap, its report may be false" in result.flagged["mallory"]


def test_flags_compare_devices_on_the_probes_every_device_tested() -> None:
    # Only dana tests the large probe (it fails on her classes); on the small probe she agrees with the others.
    reports = {
        "ann": [(60, 100), (0, 0)],
        "bob": [(62, 100), (0, 0)],
        "cat": [(58, 100), (0, 0)],
        "dana": [(61, 100), (5, 100)],
    }
    assert disagreements(reports, 2, {}) == ({}, {})
