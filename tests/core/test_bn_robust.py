"""Federated BN statistics one device cannot steer (feast_edge.evaluate.bn_robust, issue 35): real BN moments of real
Fashion-MNIST images on label-skewed devices, and the lies issue 35 measured."""

from __future__ import annotations

import pytest
import torch

from feast_edge.cache.variants import load_cache
from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate.bn_robust import Report, capped, robust_statistics, weighted_median
from feast_edge.evaluate.bn_stats import Stats, bn_statistics, combine_statistics
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from strategies import FMNIST_TINY

PRESET = load_preset(str(FMNIST_TINY))


@pytest.fixture(scope="module")
def honest(fashion_mnist_dir) -> list[Report]:
    """Six devices, each holding 2-4 of the ten classes (label skew), 60 images each: their BN moments of one variant."""
    data = load_fashion_mnist(fashion_mnist_dir, "test")
    model = extract(Supernet(PRESET, seed=0), load_cache(PRESET).entries[-1].arch)
    holdings = [(0, 1), (2, 3, 4), (5, 6), (7, 8, 9), (0, 4, 6, 8), (1, 3, 5)]
    reports = []
    for k, classes in enumerate(holdings):
        index = torch.cat([(data.labels == c).nonzero().flatten()[:30] for c in classes])[:60]
        reports.append(Report(f"honest-{k}", 50.0 + 10 * k, bn_statistics(model, data.images[index], PRESET)))
    return reports


def lied(kind: str, stats: Stats) -> Stats:
    if kind == "huge":
        return {n: (torch.full_like(m, 1e6), torch.full_like(v, 1e12)) for n, (m, v) in stats.items()}
    if kind == "zero-variance":
        return {n: (m, torch.zeros_like(v)) for n, (m, v) in stats.items()}
    if kind == "shifted":
        return {n: (m + 3 * v.sqrt(), v * 0.25) for n, (m, v) in stats.items()}
    raise ValueError(kind)


def same(a: Stats, b: Stats) -> bool:
    return all(torch.allclose(a[n][0], b[n][0]) and torch.allclose(a[n][1], b[n][1]) for n in a)


def test_honest_label_skewed_devices_are_all_used_and_get_the_exact_mixture(honest: list[Report]) -> None:
    combined = robust_statistics(honest, "screened")
    assert combined.refused == {} and combined.used == tuple(r.device for r in honest)
    assert same(combined.stats, combine_statistics([(r.weight, r.stats) for r in honest]))


@pytest.mark.parametrize("kind", ["huge", "zero-variance", "shifted"])
@pytest.mark.parametrize("liars", [1, 2])
def test_a_lying_minority_is_refused_named_and_the_honest_mixture_served(
    honest: list[Report], kind: str, liars: int
) -> None:
    sent = [Report(f"mallory-{k}", 10**6, lied(kind, honest[k].stats)) for k in range(liars)] + honest[liars:]
    combined = robust_statistics(sent, "screened")
    assert sorted(combined.refused) == [f"mallory-{k}" for k in range(liars)]
    assert all("far from the other devices'" in why for why in combined.refused.values())
    want = combine_statistics([(r.weight, r.stats) for r in honest[liars:]])
    assert same(combined.stats, want)


@pytest.mark.parametrize("kind", ["huge", "zero-variance", "shifted"])
def test_the_median_rule_stays_within_the_honest_devices_range(honest: list[Report], kind: str) -> None:
    sent = [Report("mallory", 10**6, lied(kind, honest[0].stats)), *honest[1:]]
    combined = robust_statistics(sent, "median").stats
    for name, (mean, var) in combined.items():
        means = torch.stack([r.stats[name][0] for r in honest[1:]])
        assert bool(((mean >= means.min(0).values) & (mean <= means.max(0).values)).all())
        seconds = torch.stack([r.stats[name][1] + (r.stats[name][0] - mean) ** 2 for r in honest[1:]])
        assert bool(((var >= seconds.min(0).values - 1e-9) & (var <= seconds.max(0).values + 1e-9)).all())


def test_the_mixture_is_steered_by_one_liar_and_its_claimed_weight_is_capped(honest: list[Report]) -> None:
    sent = [Report("mallory", 10**6, lied("huge", honest[0].stats)), *honest[1:]]
    steered = robust_statistics(sent, "mixture").stats
    assert max(float(m.abs().max()) for m, _ in steered.values()) > 1e4  # what the screened rule exists for
    weights = capped(sent, 8.0)
    assert weights[0] == 8 * sorted(r.weight for r in sent)[(len(sent) - 1) // 2]  # 8 lower medians, not 10**6
    assert weights[1:] == [r.weight for r in honest[1:]]


def test_two_devices_that_disagree_are_both_set_aside_and_two_that_agree_are_mixed(honest: list[Report]) -> None:
    pair = [honest[0], Report("mallory", 60.0, lied("shifted", honest[1].stats))]
    combined = robust_statistics(pair, "screened")
    assert combined.stats is None and sorted(combined.refused) == ["honest-0", "mallory"]
    assert "no third device" in combined.note
    agree = robust_statistics(honest[4:], "screened")  # two honest skewed devices
    assert agree.refused == {} and same(agree.stats, combine_statistics([(r.weight, r.stats) for r in honest[4:]]))


def test_a_lone_report_is_used_as_sent_and_said_to_be_unchecked(honest: list[Report]) -> None:
    combined = robust_statistics(honest[:1], "screened")
    assert combined.used == ("honest-0",) and "nothing to check" in combined.note


def test_weighted_median_is_the_value_holding_half_the_weight() -> None:
    values = torch.tensor([[1.0, 10.0], [2.0, 30.0], [3.0, 20.0]])
    assert weighted_median(values, torch.tensor([1.0, 1.0, 1.0])).tolist() == [2.0, 20.0]
    assert weighted_median(values, torch.tensor([5.0, 1.0, 1.0])).tolist() == [1.0, 10.0]
    assert weighted_median(values, torch.tensor([1.0, 1.0, 5.0])).tolist() == [3.0, 20.0]


def test_an_unknown_rule_names_the_rules() -> None:
    with pytest.raises(ValueError, match="screened, median, mixture"):
        robust_statistics([], "mean")
