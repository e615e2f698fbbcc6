"""SuperFedNAS / DeepFedNAS transferred: sandwich assignment, samplers, MaxNet schedule and aggregation, a short real run (method §9)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from feast_edge.local.recipe import cosine_lr
from feast_edge.route.envelope import route_state
from feast_edge.run.cohort import sample_round_cohort
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods.fednas import (
    LARGEST,
    RANDOM,
    SMALLEST,
    DeepFedNAS,
    SuperFedNAS,
    Tally,
    maxnet_share,
    maxnet_weights,
    sample_affordable_arch,
    sandwich_roles,
    tallied_role,
    weighted_slice_mean,
)
from feast_edge.sim.registry import MethodError
from feast_edge.sim.setup import SimulationConfig, build_setup
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset


def _config(fashion_mnist_dir, **kw) -> SimulationConfig:
    base = {
        "data_dir": str(fashion_mnist_dir),
        "method": "sfn",
        "clients": 6,
        "per_round": 3,
        "rounds": 6,
        "train_limit": 1200,
    }
    base |= {"val_samples": 500, "calib_samples": 200, "test_limit": 500}
    return SimulationConfig.of(**{**base, **kw})


@pytest.fixture(scope="module")
def setup(fashion_mnist_dir):
    return build_setup(_config(fashion_mnist_dir))


# ----------------------------------------------------------------------------- sandwich assignment
def test_sandwich_assignment_over_three_rounds_is_the_hand_computed_one():
    cohort = ["c", "a", "d", "b"]  # any order: roles are decided in client-id order
    tally = Tally()
    # Round 0: every count is 0 -> "largest" = a (first id), "smallest" among b, c, d = b; c and d random,
    # and c's random draw happens to be its local max (counts as "largest").
    roles = sandwich_roles(cohort, tally)
    assert roles == {"a": LARGEST, "b": SMALLEST, "c": RANDOM, "d": RANDOM}
    for client, counted in {"a": LARGEST, "b": SMALLEST, "c": LARGEST, "d": None}.items():
        tally.add(client, counted)
    # Round 1: largest counts a1 b0 c1 d0 -> b; smallest counts of a, c, d are all 0 -> a; nobody's draw hits an end.
    roles = sandwich_roles(cohort, tally)
    assert roles == {"a": SMALLEST, "b": LARGEST, "c": RANDOM, "d": RANDOM}
    tally.add("a", SMALLEST)
    tally.add("b", LARGEST)
    # Round 2: largest counts a1 b1 c1 d0 -> d; smallest counts a1 b1 c0 -> c.
    roles = sandwich_roles(cohort, tally)
    assert roles == {"a": RANDOM, "b": RANDOM, "c": SMALLEST, "d": LARGEST}
    tally.add("c", SMALLEST)
    tally.add("d", LARGEST)
    assert tally.largest == Counter(a=1, b=1, c=1, d=1)
    assert tally.smallest == Counter(a=1, b=1, c=1)


def test_sandwich_top_and_bottom_k_and_a_cohort_too_small_for_both():
    tally = Tally(Counter(a=2, b=0, c=1), Counter(a=0, b=0, c=5))
    assert sandwich_roles(["a", "b", "c"], tally, top_k=2, bottom_k=1) == {"a": SMALLEST, "b": LARGEST, "c": LARGEST}
    assert sandwich_roles(["a"], tally) == {"a": LARGEST}  # "largest" is assigned first


def test_a_random_draw_counts_as_the_end_it_hits_local_max_first():
    small, big, other = (Arch((0,) * 4, (0.25,) * 4, (i,) * 5) for i in (0, 3, 1))
    assert tallied_role(RANDOM, big, local_max=big, global_min=small) == LARGEST
    assert tallied_role(RANDOM, small, local_max=big, global_min=small) == SMALLEST
    assert tallied_role(RANDOM, small, local_max=small, global_min=small) == LARGEST
    assert tallied_role(RANDOM, other, local_max=big, global_min=small) is None
    assert tallied_role(SMALLEST, big, local_max=big, global_min=small) == SMALLEST


def test_plans_follow_the_roles_and_a_resumed_run_plans_the_same(setup, fashion_mnist_dir):
    for cls in (SuperFedNAS, DeepFedNAS):
        config = _config(fashion_mnist_dir, method=cls.name)
        budgets = dict(zip(setup.client_ids, map(float, setup.population.budgets)))
        straight = cls(setup, config)
        sequence = [
            straight.plans(t, sample_round_cohort(setup.client_ids, 3, config.seed, t), budgets.__getitem__)
            for t in range(config.training.rounds)
        ]
        resumed = cls(setup, config)  # a fresh process resuming at round 4 replays rounds 0..3
        assert (
            resumed.plans(4, sample_round_cohort(setup.client_ids, 3, config.seed, 4), budgets.__getitem__)
            == sequence[4]
        )
        assert (
            straight.plans(2, sample_round_cohort(setup.client_ids, 3, config.seed, 2), budgets.__getitem__)
            == sequence[2]
        )  # asked again
        for plans in sequence:
            assert Counter(p.role for p in plans.values()) == Counter({LARGEST: 1, SMALLEST: 1, RANDOM: 1})
            for cid, plan in plans.items():
                local_max = setup.cache.largest_affordable(budgets[cid])
                assert (
                    plan.macs <= budgets[cid]
                    and plan.macs == arch_cost(setup.preset, plan.arch, setup.cache.classes)[0]
                )
                if plan.role == LARGEST:
                    assert plan.arch == local_max.arch
                if plan.role == SMALLEST:
                    assert plan.arch == setup.cache.smallest.arch


# ----------------------------------------------------------------------------- samplers
def test_sfn_sampler_respects_the_budget_and_is_seed_deterministic():
    preset = load_preset("fmnist-small")
    for budget in (10e6, 20e6, 40e6):  # 19 %, 62 %, 97 % of the space fits: 50 draws all but always find one
        draws = [sample_affordable_arch(preset, budget, np.random.default_rng([s, 7]), 50, 10) for s in range(20)]
        assert all(d is not None and d[1] <= budget and d[1] == arch_cost(preset, d[0], 10)[0] for d in draws)
        assert len({d[0] for d in draws}) > 5
        again = [sample_affordable_arch(preset, budget, np.random.default_rng([s, 7]), 50, 10) for s in range(20)]
        assert again == draws
    assert (
        sample_affordable_arch(preset, 1e6, np.random.default_rng(0), 50, 10) is None
    )  # below the space's smallest (1.39M)


def test_sfn_draws_every_gene_uniformly_and_falls_back_to_the_largest_affordable_cached_variant(
    setup, fashion_mnist_dir
):
    preset = setup.preset
    rng = np.random.default_rng(3)
    draws = [sample_affordable_arch(preset, math.inf, rng, 1, 10)[0] for _ in range(3000)]
    depth = Counter(d for a in draws for d in a.d)
    assert set(depth) == set(range(preset.max_extra_blocks + 1)) and max(depth.values()) / min(depth.values()) < 1.15
    widths = Counter(w for a in draws for w in a.w)
    assert len(widths) == len(preset.width_multipliers) and max(widths.values()) / min(widths.values()) < 1.3
    method = SuperFedNAS(setup, _config(fashion_mnist_dir, method_options={"attempts": "3"}))
    entry = setup.cache.entries[0]
    assert method.draw_random(1e6, np.random.default_rng(0), entry) == (entry.arch, entry.macs)


def test_dfn_samples_only_affordable_cached_variants_and_all_of_them(setup, fashion_mnist_dir):
    method = DeepFedNAS(setup, _config(fashion_mnist_dir, method="dfn"))
    budget = setup.cache.entries[6].macs + 1
    affordable = {(e.arch, e.macs) for e in setup.cache.affordable(budget)}
    assert len(affordable) == 7
    local_max = setup.cache.largest_affordable(budget)
    draws = [method.draw_random(budget, np.random.default_rng([s, 1]), local_max) for s in range(300)]
    assert set(draws) == affordable


# ----------------------------------------------------------------------------- MaxNet
def test_maxnet_schedule_at_the_start_middle_and_end():
    # a0 = 0.9, rho = 0.125/0.9 => a(t) = 0.775 · ½(1 + cos(πt/T)) + 0.125
    assert maxnet_share(0, 10) == pytest.approx(0.9)
    assert maxnet_share(5, 10) == pytest.approx(0.775 * 0.5 + 0.125)  # 0.5125
    assert maxnet_share(9, 10) == pytest.approx(0.775 * 0.5 * (1 - 0.9510565163) + 0.125)  # cos(0.9π); ≈ 0.14397
    assert maxnet_share(12, 10) == pytest.approx(0.125)  # held after the horizon


def test_method_share_anneals_over_the_rounds_or_a_fraction_of_them(setup, fashion_mnist_dir):
    full = SuperFedNAS(setup, _config(fashion_mnist_dir, rounds=10))
    assert [full.share(t) for t in (0, 5, 9)] == pytest.approx([0.9, 0.5125, 0.775 * 0.5 * (1 - 0.9510565163) + 0.125])
    short = SuperFedNAS(
        setup, _config(fashion_mnist_dir, rounds=10, method_options={"anneal": "0.8", "a0": "0.8", "rho_final": "0.5"})
    )
    assert short.share(4) == pytest.approx(0.8 * (0.5 * 0.5 + 0.5)) and short.share(8) == short.share(
        9
    ) == pytest.approx(0.4)


def test_maxnet_weights_split_the_share_by_sample_count():
    assert maxnet_weights({"a": 10, "b": 20, "c": 30}, {"a"}, 0.6) == pytest.approx({"a": 0.6, "b": 0.16, "c": 0.24})
    assert maxnet_weights({"a": 10, "b": 30, "c": 30}, {"a", "b"}, 0.6) == pytest.approx(
        {"a": 0.15, "b": 0.45, "c": 0.4}
    )
    assert maxnet_weights({"b": 20, "c": 30}, {"a"}, 0.6) == pytest.approx(
        {"b": 0.16, "c": 0.24}
    )  # max-net update missing


def test_overlap_aware_weighted_average_is_the_hand_computed_one():
    glob = {"v": torch.full((4,), 100.0), "m": torch.full((3, 3), 100.0), "n": torch.tensor(5)}
    weights = maxnet_weights({"A": 10, "B": 20, "C": 30}, {"A"}, 0.6)  # A 0.6, B 0.16, C 0.24
    a = {"v": torch.full((2,), 1.0), "m": torch.full((1, 1), 1.0), "n": torch.tensor(7)}
    b = {"v": torch.full((3,), 2.0), "m": torch.full((2, 3), 2.0), "n": torch.tensor(6)}
    c = {"v": torch.full((1,), 3.0), "m": torch.full((3, 2), 3.0)}
    weighted_slice_mean(glob, [(a, weights["A"]), (b, weights["B"]), (c, weights["C"])])
    # v[0]: A, B, C -> 0.6·1 + 0.16·2 + 0.24·3 = 1.64 (weights sum to 1); v[1]: A, B -> 0.92 / 0.76;
    # v[2]: B alone -> 2; v[3]: nobody -> unchanged.
    assert glob["v"].tolist() == pytest.approx([1.64, 0.92 / 0.76, 2.0, 100.0])
    # m[0,0]: all three -> 1.64; where only B and C cover, their n-weighted mean (20·2 + 30·3)/50 = 2.6;
    # B alone -> 2, C alone -> 3, nobody -> 100.
    expected = [[1.64, 2.6, 2.0], [2.6, 2.6, 2.0], [3.0, 3.0, 100.0]]
    assert glob["m"].tolist() == [pytest.approx(row) for row in expected]
    assert int(glob["n"]) == 7  # integer buffers: the maximum of the senders


def test_aggregate_gives_the_largest_role_client_the_maxnet_share(setup, fashion_mnist_dir):
    method = DeepFedNAS(setup, _config(fashion_mnist_dir, method="dfn"))
    glob = {"w": torch.zeros(2)}
    plans = method.plans(0, ["client-000", "client-001"], lambda c: 40e6)
    big = next(c for c, p in plans.items() if p.role == LARGEST)
    updates = [ClientUpdate(c, {"w": torch.full((2,), 1.0 if c == big else 0.0)}, 50) for c in sorted(plans)]
    method.aggregate(0, glob, updates, plans)
    assert glob["w"].tolist() == pytest.approx([0.9, 0.9])


# ----------------------------------------------------------------------------- options, payload, a real run
def test_options_out_of_range_or_unknown_are_one_line_errors():
    with pytest.raises(MethodError, match="a0 = 1.0 must be in"):
        SuperFedNAS.parse_options({"a0": "1"})
    with pytest.raises(MethodError, match="takes no option attempts"):
        DeepFedNAS.parse_options({"attempts": "5"})
    assert SuperFedNAS.parse_options({})["attempts"] == 50 and DeepFedNAS.parse_options({})[
        "rho_final"
    ] == pytest.approx(0.125 / 0.9)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [SuperFedNAS, DeepFedNAS])
def test_short_real_run_serves_its_largest_variant_above_chance(cls, fashion_mnist_dir):
    # Near-IID shards and budgets every client shares, so each round's max-net client trains the largest
    # served variant; no augmentation and a larger lr, so three rounds are enough to leave chance.
    config = _config(
        fashion_mnist_dir,
        method=cls.name,
        per_round=6,
        rounds=3,
        budgets=(8e6,) * 6,
        alpha_eff=100.0,
        gamma=0.0,
        augment="none",
        batch_size=32,
        lr=0.05,
    )
    setup = build_setup(config)
    method = cls(setup, config)
    for t in range(config.training.rounds):
        cohort = sample_round_cohort(setup.client_ids, config.population.per_round, config.seed, t)
        plans = method.plans(t, cohort, lambda c: 8e6)
        glob = method.model.state_dict()
        before = {k: v.clone() for k, v in glob.items()}
        updates = method.collect(t, cohort, plans, glob, cosine_lr(config.train_config().lr, t, config.training.rounds))
        assert all(torch.equal(before[k], v) for k, v in glob.items())  # train_client copies what it sends
        for u in updates:
            layout = arch_layout(setup.preset, plans[u.client].arch, setup.preset.classes)
            sent = route_state(glob, layout, setup.preset)
            assert {k: v.shape for k, v in u.state.items()} == {k: v.shape for k, v in sent.items()}
            params = {k for k, _ in method.model.named_parameters()}
            assert method.payload_params(plans[u.client]) == sum(v.numel() for k, v in sent.items() if k in params)
            assert u.train_macs == 3 * u.samples_seen * plans[u.client].macs and math.isfinite(u.loss)
        method.aggregate(t, glob, updates, plans)
    top = method.served(8e6)
    calibration = setup.calibration_images()
    [accuracy] = method.evaluate(
        [method.points()[top]], calibration, setup.test_set.images[:500], setup.test_set.labels[:500]
    )
    assert accuracy > 0.2
