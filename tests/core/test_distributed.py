"""feast_edge.sim.distributed's pieces: the cost-balanced split, the update wire format, and the purity spreading relies on."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.distributed import assign, check_spread
from feast_edge.sim.methods import METHODS, method_class
from feast_edge.sim.ranks import DistributedError, pack_updates, pick_backend, plans_digest, unpack_updates
from feast_edge.sim.setup import build_setup
from simconfigs import tiny_config

CONFIG = tiny_config(clients=6, per_round=4, rounds=4, train_limit=300, val_samples=50, eval_every=5, seed=5)
SPREADABLE = [m for m in METHODS if m != "centralized"]


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(0.0, 1e9), min_size=1, max_size=24), size=st.integers(1, 8))
def test_assign_covers_the_cohort_once_and_balances_like_list_scheduling(costs, size):
    cohort = [f"c{i:02d}" for i in range(len(costs))]
    parts = assign(cohort, costs, size)
    assert len(parts) == size
    assert sorted(c for p in parts for c in p) == cohort
    assert all(p == sorted(p) for p in parts)  # each part in cohort order
    if len(cohort) >= size:
        assert all(parts)  # every process trains someone
    cost = dict(zip(cohort, costs))
    loads = [sum(cost[c] for c in p) for p in parts]
    assert max(loads) <= sum(costs) / size + max(costs) + 1e-6 * sum(costs)  # Graham's bound for greedy scheduling
    assert assign(cohort, costs, size) == parts


def test_assign_puts_the_costliest_members_apart():
    parts = assign(["a", "b", "c", "d"], [10.0, 9.0, 1.0, 1.0], 2)
    assert parts == [["a", "d"], ["b", "c"]]


def test_updates_survive_the_wire_format_exactly():
    updates = [
        ClientUpdate(
            "client-001",
            {"w": torch.randn(3, 4), "h": torch.randn(5).half(), "n": torch.tensor(7)},
            40,
            loss=0.1 + 0.2,
            samples_seen=80.0,
            train_macs=123456789012,
            compute_seconds=1.25,
            variants_per_batch={"3": 4},
        ),
        ClientUpdate("client-002", {}, 3, loss=float("nan")),
    ]
    back = unpack_updates(pack_updates(updates))
    assert [u.client for u in back] == ["client-001", "client-002"]
    for a, b in zip(updates, back):
        assert a.state.keys() == b.state.keys()
        assert all(torch.equal(a.state[k], b.state[k]) and a.state[k].dtype == b.state[k].dtype for k in a.state)
        assert (a.samples, a.samples_seen, a.train_macs, a.compute_seconds, dict(a.variants_per_batch)) == (
            b.samples,
            b.samples_seen,
            b.train_macs,
            b.compute_seconds,
            dict(b.variants_per_batch),
        )
    assert back[0].loss == 0.1 + 0.2 and math.isnan(back[1].loss)
    assert unpack_updates(b"") == []


@pytest.mark.parametrize(
    "nproc, fragment", [(0, "--nproc 0 must be at least 1"), (5, "--nproc 5 exceeds the cohort (--per-round 4)")]
)
def test_check_spread_refuses_counts_the_cohort_cannot_use(nproc, fragment):
    with pytest.raises(DistributedError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_spread(CONFIG, nproc)


def test_only_the_pooled_reference_cannot_be_spread():
    for method in SPREADABLE:
        check_spread(CONFIG.changed(method=method), 4)
    with pytest.raises(DistributedError, match="--method centralized trains one pooled model"):
        check_spread(CONFIG.changed(method="centralized"), 2)
    check_spread(CONFIG.changed(method="centralized"), 1)


def test_backend_choice():
    assert pick_backend("auto", "cpu", 2) == "gloo"
    assert pick_backend("gloo", "cpu", 2) == "gloo"
    with pytest.raises(DistributedError, match="nccl needs CUDA GPUs"):
        pick_backend("nccl", "cpu", 2)
    with pytest.raises(DistributedError, match="choose one of auto, gloo, nccl"):
        pick_backend("mpi", "cpu", 2)


@pytest.fixture(scope="module")
def setup(fashion_mnist_dir):
    return build_setup(CONFIG)


def _budget(setup):
    budgets = {c: float(b) for c, b in zip(setup.client_ids, setup.population.budgets)}
    return budgets.__getitem__


@pytest.mark.parametrize("method", SPREADABLE)
def test_a_worker_plans_a_round_as_rank_0_did(setup, method):
    """A worker sees only some rounds (it may join a resumed run): its plans must still equal rank 0's, which saw them all."""
    from feast_edge.run.cohort import sample_round_cohort

    config = CONFIG.changed(method=method)
    rank0, worker = (method_class(method)(setup, config) for _ in range(2))
    cohorts = [
        sample_round_cohort(setup.client_ids, config.population.per_round, config.seed, t)
        for t in range(config.training.rounds)
    ]
    seen = [plans_digest(rank0.plans(t, c, _budget(setup)), c) for t, c in enumerate(cohorts)]
    assert plans_digest(worker.plans(3, cohorts[3], _budget(setup)), cohorts[3]) == seen[3]
    assert len(set(seen)) == len(seen)  # the digest tells rounds apart


@pytest.mark.parametrize("method", SPREADABLE)
def test_a_clients_update_does_not_depend_on_what_its_process_trained_before(setup, method, one_thread):
    """Spreading moves clients between processes: an update must be a function of its inputs alone."""
    config = CONFIG.changed(method=method)
    cohort = setup.client_ids[:2]
    alone, after = (method_class(method)(setup, config) for _ in range(2))
    plans = alone.plans(1, cohort, _budget(setup))
    state = alone.delivered(alone.model.state_dict())
    first = alone.train_one(1, cohort[1], plans[cohort[1]], state, 0.05)
    after.train_one(1, cohort[0], plans[cohort[0]], after.delivered(after.model.state_dict()), 0.05)
    second = after.train_one(1, cohort[1], plans[cohort[1]], after.delivered(after.model.state_dict()), 0.05)
    assert first.samples_seen > 0 and first.state
    assert first.state.keys() == second.state.keys()
    assert all(torch.equal(first.state[k], second.state[k]) for k in first.state)
    assert first.loss == second.loss
