"""The held-out split: deterministic, per class, at least one example of every class that has two, never a class's only one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.data.holdout import holdout_split
from feast_edge.data.images import DataError

labels_st = st.lists(st.integers(0, 6), min_size=0, max_size=120).map(lambda v: torch.tensor(v, dtype=torch.long))


@settings(max_examples=150, deadline=None)
@given(labels=labels_st, fraction=st.floats(0.0, 0.9), seed=st.integers(0, 2**16))
def test_the_split_is_a_per_class_partition(labels: torch.Tensor, fraction: float, seed: int) -> None:
    train, held = holdout_split(labels, fraction, seed)
    assert train.dtype == held.dtype == torch.long
    both = torch.cat([train, held])
    assert sorted(both.tolist()) == list(range(len(labels)))  # every example exactly once
    assert train.tolist() == sorted(train.tolist()) and held.tolist() == sorted(held.tolist())
    for label in set(labels.tolist()):
        n = int((labels == label).sum())
        k = int((labels[held] == label).sum())
        if n == 1 or fraction == 0:
            assert k == 0  # a class's only example trains
        else:
            assert 1 <= k <= n - 1 and k == min(n - 1, max(1, math.floor(fraction * n + 0.5)))
    again = holdout_split(labels, fraction, seed)
    assert torch.equal(again[0], train) and torch.equal(again[1], held)  # deterministic


def test_a_class_draws_its_own_examples_whatever_the_others_hold() -> None:
    labels = torch.tensor([0, 1] * 20)
    _, held = holdout_split(labels, 0.25, seed=3)
    alone = torch.nonzero(labels == 1).flatten()
    _, held_alone = holdout_split(labels[alone], 0.25, seed=3)
    assert alone[held_alone].tolist() == [i for i in held.tolist() if labels[i] == 1]
    other_seed = holdout_split(labels, 0.25, seed=4)[1]
    assert other_seed.tolist() != held.tolist()


def test_fraction_zero_holds_out_nothing_and_bad_fractions_are_refused() -> None:
    train, held = holdout_split(np.array([3, 3, 1]), 0.0)
    assert train.tolist() == [0, 1, 2] and held.numel() == 0
    for bad in (-0.1, 0.95, float("nan"), "0.1"):
        with pytest.raises(DataError, match="must be a fraction between 0 and 0.9"):
            holdout_split(torch.tensor([0, 0]), bad)  # type: ignore[arg-type]
