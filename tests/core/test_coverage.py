"""Class coverage of a label-skewed fleet and the serving rule (feast_edge/evaluate/coverage.py)."""

from __future__ import annotations

import pytest

from feast_edge.budget.derive import evaluation_limit, evaluation_memory_bytes, training_memory_bytes
from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.coverage import (
    LARGEST,
    NOT_VALIDATED,
    SERVE_MARGIN,
    Holder,
    coverage_warnings,
    holder_of,
    required_gain,
    serving_choice,
    variant_coverage,
)
from feast_edge.route.envelope import Envelope
from feast_edge.space.preset import load_preset

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _counts(*classes: int, n: int = 10) -> tuple[int, ...]:
    return tuple(n if k in classes else 0 for k in range(len(NAMES)))


# The digits fleet: the 7.06M variant is reachable only by dev-c, which lacks two, three and four.
FLEET = [
    Holder("dev-a", 800_000, 800_000, _counts(0, 1, 2, 3), _counts(0, 1, 2, 3, n=2)),
    Holder("dev-b", 3_000_000, 3_000_000, _counts(2, 3, 4, 5, 6, 7), _counts(2, 3, 4, 5, 6, 7, n=2)),
    Holder("dev-c", 8_000_000, 8_000_000, _counts(0, 1, 5, 6, 7, 8, 9), _counts(0, 1, 5, 6, 7, 8, 9, n=2)),
]


def test_a_variant_is_trained_on_the_classes_of_the_devices_whose_budget_admits_it() -> None:
    top = variant_coverage(FLEET, 7_060_000, 10)
    assert top.trained_by == ("dev-c",) and sorted(top.trained) == [0, 1, 5, 6, 7, 8, 9]
    middle = variant_coverage(FLEET, 2_930_000, 10)
    assert middle.trained_by == ("dev-b", "dev-c") and sorted(middle.trained) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert variant_coverage(FLEET, 700_000, 10).trained_by == ("dev-a", "dev-b", "dev-c")


def test_validation_covers_the_held_out_classes_of_every_device_that_may_evaluate_the_variant() -> None:
    assert sorted(variant_coverage(FLEET, 7_060_000, 10).validated) == [0, 1, 5, 6, 7, 8, 9]
    # dev-a and dev-b may evaluate (not serve) the top variant: its validation now sees every class.
    lifted = [Holder(h.device, h.budget_macs, 8_000_000, h.class_counts, h.holdout_counts) for h in FLEET]
    top = variant_coverage(lifted, 7_060_000, 10)
    assert top.validated_by == ("dev-a", "dev-b", "dev-c") and len(top.validated) == 10
    assert top.trained_by == ("dev-c",)  # evaluating is not training


def test_a_device_without_a_held_out_split_does_not_count_as_validating() -> None:
    silent = Holder("dev-d", 8_000_000, 8_000_000, _counts(2, 3), ())
    assert "dev-d" not in variant_coverage([*FLEET, silent], 7_060_000, 10).validated_by


def test_calibration_coverage_is_that_of_the_devices_that_gave_statistics() -> None:
    cov = variant_coverage(FLEET, 2_930_000, 10, calibrated_by=["dev-b"])
    assert sorted(cov.calibrated) == [2, 3, 4, 5, 6, 7] and cov.calibrated_by == ("dev-b",)
    described = cov.to_dict(NAMES)
    assert described["calibrated"]["missing"] == ["zero", "one", "eight", "nine"]
    assert variant_coverage(FLEET, 2_930_000, 10).to_dict(NAMES)["calibrated"] is None


def test_the_warnings_name_unheld_classes_single_class_devices_and_partly_trained_served_variants() -> None:
    fleet = [
        Holder("a", 1_000_000, 1_000_000, _counts(0, 1, 2), _counts(0, 1, 2, n=1)),
        Holder("solo", 1_000_000, 1_000_000, _counts(3), _counts(3, n=1)),
        Holder("top", 9_000_000, 9_000_000, _counts(0, 1), _counts(0, 1, n=1)),
    ]
    lines = coverage_warnings(fleet, [1_000_000, 9_000_000], NAMES)
    assert lines[0].startswith("no registered device holds classes four, five, six, seven, eight, nine")
    assert any(line.startswith("solo holds one class only (three)") for line in lines)
    top = [line for line in lines if line.startswith("variant 9.00M")]
    # Trained and validated by "top" alone: both miss two and three (the classes nobody holds are said once above).
    assert "trained only by top, on 2 of 10 classes (missing two, three)" in top[0]
    assert "validated on 2 of 10 classes (missing two, three;" in top[1]
    assert not any(line.startswith("variant 1.00M") for line in lines)


def test_a_fleet_that_holds_every_class_everywhere_gets_no_warning() -> None:
    everything = _counts(*range(10))
    fleet = [Holder(d, b, b, everything, everything) for d, b in (("a", 1_000_000), ("b", 9_000_000))]
    assert coverage_warnings(fleet, [1_000_000, 9_000_000], NAMES) == []


def test_devices_without_counts_are_left_out_and_named() -> None:
    lines = coverage_warnings([*FLEET, Holder("old", 8_000_000, 8_000_000)], [7_060_000], NAMES)
    assert lines[-1].startswith("old registered no per-class counts")
    assert coverage_warnings([Holder("old", 8_000_000, 8_000_000)], [7_060_000], NAMES) == []


def test_a_registry_profile_becomes_a_holder_whose_evaluation_limit_is_at_least_its_budget() -> None:
    profile = {"class_counts": [1, 0, 2], "holdout_counts": [0, 0, 1], "evaluate_macs": 5}
    holder = holder_of("d", 100, profile)
    assert holder.evaluate_macs == 100 and holder.classes() == {0, 2} and holder.holdout_classes() == {2}
    assert holder_of("d", 100, {"evaluate_macs": 500}).evaluate_macs == 500
    assert not holder_of("d", 100, {"class_counts": "lies"}).known


AFFORDABLE = [(0, 700_000), (4, 2_930_000), (9, 7_060_000)]


def test_the_largest_affordable_variant_is_served_unless_a_smaller_one_is_clearly_better() -> None:
    chosen = serving_choice(AFFORDABLE, {0: 0.90, 4: 0.95, 9: 0.688})
    assert (chosen.index, chosen.macs, chosen.largest_macs) == (4, 2_930_000, 7_060_000)
    assert chosen.rule == "better on validation: 95.0% vs 68.8% for the 7.06M variant"
    kept = serving_choice(AFFORDABLE, {0: 0.90, 4: 0.915, 9: 0.90})
    assert (kept.index, kept.rule, kept.accuracy) == (9, LARGEST, 0.90)  # 1.5 points: within the margin


def test_a_largest_variant_without_a_validation_figure_is_served_and_says_so() -> None:
    chosen = serving_choice(AFFORDABLE, {0: 0.99})
    assert (chosen.index, chosen.rule, chosen.accuracy) == (9, NOT_VALIDATED, None)
    with pytest.raises(ValueError):
        serving_choice([], {})


def test_among_better_smaller_variants_the_best_is_served_and_ties_go_to_the_larger() -> None:
    assert serving_choice(AFFORDABLE, {0: 0.95, 4: 0.95, 9: 0.5}).index == 4
    assert serving_choice(AFFORDABLE, {0: 0.97, 4: 0.95, 9: 0.5}).index == 0


def test_evaluating_a_variant_needs_far_less_memory_than_training_it_and_the_limit_grows_with_memory() -> None:
    preset = load_preset("fmnist-small")
    cache = load_cache(preset)
    top = cache.entries[-1]
    archs = [e.arch for e in cache.entries]
    params = Envelope.of(archs).params(preset, cache.classes)
    trains = training_memory_bytes(preset, params, 64, archs, cache.classes)
    assert 0 < evaluation_memory_bytes(cache, preset, top.macs, batch_size=64) < trains  # no gradients, no momentum
    evaluates = evaluation_memory_bytes(cache, preset, top.macs)
    assert evaluation_limit(cache, preset, evaluates) == top.macs
    assert evaluation_limit(cache, preset, evaluates - 1) < top.macs
    assert evaluation_limit(cache, preset, 1) == 0


def test_a_difference_the_held_out_splits_cannot_tell_from_noise_swaps_nothing() -> None:
    # 5 points better on 100 examples each: about 1.3 standard errors, not 2; on 2,000 each: about 6.
    assert serving_choice(AFFORDABLE, {4: 0.85, 9: 0.80}, {4: 100, 9: 100}).index == 9
    assert serving_choice(AFFORDABLE, {4: 0.85, 9: 0.80}, {4: 2000, 9: 2000}).index == 4
    assert required_gain(0.8, 0.85, 100, 100, SERVE_MARGIN) == pytest.approx(
        2 * ((0.8 * 0.2 + 0.85 * 0.15) / 100) ** 0.5
    )
    assert required_gain(1.0, 1.0, 10**6, 10**6, SERVE_MARGIN) == SERVE_MARGIN  # never below the margin
    assert required_gain(0.5, 0.9, None, 100, SERVE_MARGIN) == SERVE_MARGIN  # examples unknown: the margin alone
