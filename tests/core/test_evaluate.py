"""Evaluation: per-variant BN recalibration on server-held data, largest-affordable population accuracy."""

from __future__ import annotations

import pytest
import torch

from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate.evaluation import (
    accuracy,
    calibrated_variant,
    evaluate_variants,
    largest_affordable_index,
    population_accuracy,
)
from feast_edge.space.arch import Arch
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

SMALL = load_preset("fmnist-small")


@pytest.fixture(scope="module")
def fmnist(fashion_mnist_dir):
    return load_fashion_mnist(fashion_mnist_dir, "test")


def test_accuracy_counts_correct_predictions(fmnist):
    class Oracle(torch.nn.Module):
        def __init__(self, labels):
            super().__init__()
            self.labels, self.seen = labels, 0

        def forward(self, x):
            out = torch.nn.functional.one_hot(self.labels[self.seen : self.seen + x.shape[0]], 10).float()
            self.seen += x.shape[0]
            return out

    images, labels = fmnist.images[:300], fmnist.labels[:300]
    assert accuracy(Oracle(labels), images, labels, SMALL, batch_size=70) == 1.0
    wrong = (labels + 1) % 10
    assert accuracy(Oracle(wrong), images, labels, SMALL, batch_size=70) == 0.0


def test_recalibration_is_per_variant_and_leaves_supernet_alone(fmnist):
    supernet = Supernet(SMALL, seed=0)
    before = {k: v.clone() for k, v in supernet.state_dict().items()}
    a, b = Arch.smallest(SMALL), Arch((1, 1, 1, 1), (0.5,) * 4, (4,) * 5)
    ma = calibrated_variant(supernet, a, fmnist.images[:200])
    mb = calibrated_variant(supernet, b, fmnist.images[:200])
    # the stem sees the same pixels in both variants, so its statistics agree; the first block's do not
    n = ma.stem.bn.running_mean.shape[0]
    assert torch.allclose(ma.stem.bn.running_mean, mb.stem.bn.running_mean[:n], atol=1e-6)
    m = ma.stages[0][0].bn1.running_mean.shape[0]
    assert not torch.allclose(ma.stages[0][0].bn1.running_mean, mb.stages[0][0].bn1.running_mean[:m])
    assert all(torch.equal(v, before[k]) for k, v in supernet.state_dict().items())


def test_evaluate_variants_reports_one_accuracy_per_arch(fmnist):
    supernet = Supernet(SMALL, seed=0)
    archs = [Arch.smallest(SMALL), Arch((0, 0, 0, 0), (0.5,) * 4, (2,) * 5)]
    calls = []
    accs = evaluate_variants(
        supernet,
        archs,
        fmnist.images[:100],
        fmnist.images[100:300],
        fmnist.labels[100:300],
        progress=lambda i, n: calls.append((i, n)),
    )
    assert len(accs) == 2 and all(0.0 <= x <= 1.0 for x in accs)
    assert calls == [(1, 2), (2, 2)]


def test_largest_affordable_serving():
    macs = [10, 20, 30]
    assert largest_affordable_index(macs, 25) == 1
    assert largest_affordable_index(macs, 30) == 2
    with pytest.raises(ValueError, match="below the smallest variant"):
        largest_affordable_index(macs, 5)
    served = [largest_affordable_index(macs, b) for b in (10, 25, 100, 100)]
    assert population_accuracy(served, [0.5, 0.6, 0.9]) == pytest.approx((0.5 + 0.6 + 0.9 + 0.9) / 4)
