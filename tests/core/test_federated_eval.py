"""Evaluation where the data lives (feast_edge.evaluate.federated): the devices' counts equal the server-held protocol on the same examples."""

from __future__ import annotations

import pytest
import torch

from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.evaluation import calibrated_variant, evaluate_variants
from feast_edge.evaluate.federated import (
    calibrated_static,
    calibration_subset,
    combine_counts,
    federated_accuracy,
    held_out_counts,
    robust_validation,
    routed_supernet,
)
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import plan_client
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

PRESET = load_preset("fmnist-small")


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    train = torch.randint(0, 256, (60, 1, 28, 28), generator=g, dtype=torch.uint8)
    held = torch.randint(0, 256, (25, 1, 28, 28), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 10, (25,), generator=g)
    return train, held, labels, torch.arange(60) // 6  # training labels sorted by class, as an image folder is


def test_a_devices_counts_are_the_server_held_protocol_on_its_examples(data) -> None:
    train, held, labels, _ = data
    supernet = Supernet(PRESET, seed=1)
    cache = load_cache(PRESET)
    plan = plan_client(cache, 20e6)
    routed = routed_supernet(PRESET, plan, route_state(supernet.state_dict(), plan.layout(PRESET, 10), PRESET))
    probes = [plan.affordable[0], plan.affordable[-1]]
    counts = held_out_counts(routed, probes, train, held, labels, calibration=40)
    # The server-held protocol, handed the same calibration sample and the same held-out split:
    want = evaluate_variants(supernet, probes, calibration_subset(train, 40), held, labels)
    assert [c / n for c, n in counts] == pytest.approx(want) and all(n == 25 for _, n in counts)


def test_calibration_draws_from_every_class_of_a_class_sorted_split(data) -> None:
    train, _, _, sorted_labels = data
    picked = calibration_subset(sorted_labels.view(-1, 1, 1, 1), 20).flatten()
    assert len(set(picked.tolist())) >= 8  # the first 20 of the sorted split would be 4 classes
    assert torch.equal(picked, calibration_subset(sorted_labels.view(-1, 1, 1, 1), 20).flatten())  # fixed
    assert torch.equal(calibration_subset(train, 10**6).sort(dim=0).values, train.sort(dim=0).values)  # all of them


def test_a_served_variant_calibrated_on_the_device_equals_the_extracted_calibrated_one(data) -> None:
    train, _, _, _ = data
    supernet = Supernet(PRESET, seed=2)
    arch = load_cache(PRESET).entries[5].arch
    model = extract(supernet, arch)
    assert calibrated_static(model, PRESET, train, calibration=50) == 50
    reference = calibrated_variant(supernet, arch, calibration_subset(train, 50))
    for name, tensor in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name].float(), tensor.float(), atol=1e-6), name


def test_counts_combine_sample_weighted_and_untested_probes_are_left_out() -> None:
    combined = combine_counts([[(8, 10), (0, 0)], [(1, 30), (0, 0)]], probes=2)
    assert combined == [(9, 40), (0, 0)]
    assert federated_accuracy(combined) == pytest.approx(9 / 40)  # not (0.8 + 1/30) / 2: weighted by examples
    assert federated_accuracy(combine_counts([[(1, 2), (3, 4)]], 2)) == pytest.approx((0.5 + 0.75) / 2)
    assert federated_accuracy([(0, 0), (0, 0)]) is None
    assert (
        held_out_counts(
            Supernet(PRESET, seed=0), [], torch.zeros(0, 1, 28, 28, dtype=torch.uint8), *[torch.zeros(0)] * 2
        )
        == []
    )


def test_a_skewed_device_calibrates_on_its_classes_as_if_they_were_equally_frequent() -> None:
    labels = torch.tensor([0] * 90 + [1] * 8 + [2] * 2)
    images = torch.arange(100).view(100, 1, 1, 1)
    picked = calibration_subset(images, 30, labels).flatten()
    assert len(picked) == 30 and torch.bincount(labels[picked], minlength=3).tolist() == [10, 10, 10]
    assert len(set(picked[labels[picked] == 0].tolist())) == 10  # a class with enough examples: no repeats
    assert torch.equal(picked, calibration_subset(images, 30, labels).flatten())  # fixed


def test_the_median_of_three_devices_is_not_moved_by_a_liar_and_the_liar_is_named() -> None:
    # Issue 35's liar: all of its held-out examples right, at a count far above the others'.
    reports = {"a": [(40, 100), (45, 100)], "b": [(38, 100), (0, 0)], "mallory": [(10**6, 10**6), (10**6, 10**6)]}
    result = robust_validation(reports, 2)
    assert result.points == [
        pytest.approx(0.40),
        pytest.approx((0.45 + 1.0) / 2),
    ]  # per probe, over those who tested it
    # The second probe has two testers, whose median the liar sets: only the first, tested by three, chooses the round.
    assert result.selects and result.accuracy == pytest.approx(0.40)
    assert list(result.flagged) == ["mallory"] and "100.0%" in result.flagged["mallory"]
    pooled = robust_validation(reports, 2, "pooled", max_weight_ratio=8.0)
    # pooled: mallory's 10**6 examples weigh as 8 lower medians (800): it still pulls the figure (what median avoids)
    assert pooled.points[0] == pytest.approx((40 + 38 + 800) / (100 + 100 + 800))


def test_fewer_than_three_devices_show_a_figure_that_does_not_choose_the_served_round() -> None:
    result = robust_validation({"a": [(30, 100)], "mallory": [(169, 169)]}, 1)
    assert result.points == [pytest.approx((0.3 + 1.0) / 2)] and not result.selects and result.flagged == {}
    assert robust_validation({"a": [(3, 10)], "b": [(4, 10)], "c": [(5, 10)]}, 1).selects


def test_honest_devices_that_differ_by_their_data_are_not_flagged() -> None:
    # Label-skewed devices differ by tens of points; only a device far outside the others' own spread is named.
    reports = {"pi": [(82, 100)], "jetson": [(60, 100)], "laptop": [(88, 100)], "desktop": [(89, 100)]}
    assert robust_validation(reports, 1).flagged == {}
    reports["jetson"] = [(8, 100)]  # the demo's jetson-nano: a model useless on its data is worth a line
    assert "data differs" in robust_validation(reports, 1).flagged["jetson"]


def test_an_unknown_validation_rule_names_the_rules() -> None:
    with pytest.raises(ValueError, match="median, pooled"):
        robust_validation({}, 1, "mean")
