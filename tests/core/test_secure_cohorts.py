"""Secure rounds never serve slices that never trained (docs/security.md §10): the stratified cohort, the caps on what
a fleet and a round can reveal, the record of what the releases moved, and ε under stratified cohorts."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.aggregate.released import Released, trained_variants
from feast_edge.aggregate.segments import plain_sums
from feast_edge.cache.variants import CacheError, load_cache
from feast_edge.privacy.accountant import accounted
from feast_edge.privacy.private_rounds import PrivateRounds
from feast_edge.privacy.settings import DpSettings
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import plan_client
from feast_edge.route.reveal import Reveal
from feast_edge.run.cohort import inclusion, round_rng, sample_cohort, sample_round_cohort, stratified_cohort
from feast_edge.run.collect import Collected
from feast_edge.run.schedule import SyncRounds
from feast_edge.run.stages import release_of
from feast_edge.run.stages.released import ReleasedStage, released_of
from feast_edge.run.strategy import FeastStrategy
from feast_edge.run.stratified import StratifiedRounds
from feast_edge.secagg.sums import cohort_segments
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.settings.validated import RunError
from feast_edge.sim.simulate import Simulation
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from simconfigs import tiny_config
from strategies import FMNIST_TINY

TINY = load_preset(FMNIST_TINY)
CACHE = load_cache(TINY)
MODEL = Supernet(TINY, seed=0)
SIX = [0.2e6] * 3 + [0.8e6] + [1.5e6] * 2  # three devices in the bottom tier, one in the middle, two at the top
BUDGETS = [0.15e6, 0.2e6, 0.4e6, 0.5e6, 0.8e6, 1.0e6, 1.2e6, 1.5e6]  # every tier of the fmnist-tiny cache, nearly


class Fleet:
    """A collector of fixed budgets that collects nothing: what a scheduler draws and plans, seen from outside."""

    def __init__(self, budgets: list[float]) -> None:
        self.budgets = {f"d{i:02d}": b for i, b in enumerate(budgets)}
        self.plans: dict[int, dict] = {}

    def clients(self, needed: int) -> list[str]:
        return sorted(self.budgets)

    def fleet(self) -> list[str]:
        return sorted(self.budgets)

    def budget(self, client: str) -> float:
        return self.budgets[client]

    def collect(self, t, cohort, plans, global_state, lr) -> Collected:
        self.plans[t] = dict(plans)
        return Collected([])


def _rounds(m: int, least: int, seed: int = 0, **dp: float) -> StratifiedRounds:
    secure = {"secure_agg": True, "colluders": least - 2}
    settings = RunConcerns.of_keys(rounds=200, per_round=m, seed=seed, lr=0.05, **secure, **dp)
    assert settings.reveal_over() == least
    return StratifiedRounds(settings, FeastStrategy(MODEL, CACHE), MODEL, Reveal(TINY, CACHE, least))


def _gather(rounds: StratifiedRounds, fleet: Fleet, t: int, seen: list | None = None):
    return rounds.gather(t, fleet, 1, (lambda ctx: seen.append(ctx)) if seen is not None else (lambda ctx: None), [])


def _indices(plan) -> list[int]:
    return sorted(CACHE.entries.index(next(e for e in CACHE.entries if e.arch == a)) for a in plan.affordable)


def test_a_top_tier_of_two_cannot_be_revealed_with_one_colluder_and_is_capped_at_what_three_devices_afford() -> None:
    reveal = Reveal(TINY, CACHE, 3)
    unrevealed = reveal.unrevealed(SIX)
    assert dict(unrevealed.holders) == dict.fromkeys(range(9, 14), 2)  # the 0.94M-1.40M variants: two devices each
    assert unrevealed.cap == reveal.tier(0.8e6)
    line = reveal.words(unrevealed)
    assert line.startswith("--secure-agg: variants 9-13 (0.94M-1.40M MACs) cannot be revealed: only 2 devices afford")
    assert "a sum is revealed over at least --colluders + 2 = 3 devices" in line
    assert "served variants up to 0.75M MACs" in line and "Add devices with budgets of at least 0.94M MACs" in line
    assert line.endswith("or lower --colluders")
    capped = reveal.capped(plan_client(CACHE, 1.5e6), unrevealed.cap)
    assert _indices(capped) == list(range(9))  # trains only what three devices hold
    assert capped.layout(TINY, TINY.classes) == plan_client(CACHE, 0.8e6).layout(TINY, TINY.classes)
    assert reveal.capped(plan_client(CACHE, 0.2e6), unrevealed.cap) == plan_client(CACHE, 0.2e6)  # nothing cut
    assert not Reveal(TINY, CACHE, 2).unrevealed(SIX)  # with c = 0 two devices suffice: every variant


def test_the_start_line_names_what_cannot_be_revealed_and_a_fleet_that_grows_lifts_the_cap(caplog) -> None:
    """The first round says which variants the fleet cannot reveal; a third 1.5M device changes the cap, said too,
    and the next round routes the top devices every variant they afford."""
    fleet, rounds = Fleet(SIX), _rounds(7, 3)
    with caplog.at_level(logging.INFO, logger="feast_edge.run.stratified"):
        _gather(rounds, fleet, 0)
        _gather(rounds, fleet, 1)
        fleet.budgets["d06"] = 1.5e6
        _gather(rounds, fleet, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # said once at the start, once when the fleet changed it
    assert "variants 9-13 (0.94M-1.40M MACs) cannot be revealed: only 2 devices afford them" in lines[0]
    assert "every variant the devices afford can be revealed" in lines[1]
    assert all(_indices(fleet.plans[t]["d05"]) == list(range(9)) for t in (0, 1))
    assert _indices(fleet.plans[2]["d05"]) == list(range(14))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(BUDGETS), min_size=3, max_size=12),
    st.integers(0, 2),
    st.integers(0, 10_000),
    st.data(),
)
def test_every_segment_a_stratified_secure_round_routes_has_at_least_c_plus_2_members(budgets, c, seed, data) -> None:
    """Over the real segments of the capped plans (feast_edge.aggregate.segments): none has 1 to c + 1 members; the
    uniform draw is kept when its highest tier already has c + 2, and raised to c + 2 whenever the fleet has that many
    of it; the same (seed, t) draws the same cohort."""
    least = c + 2
    if len(budgets) < least:
        return
    m = data.draw(st.integers(least, len(budgets)))
    t = data.draw(st.integers(0, 100))
    fleet, rounds = Fleet(budgets), _rounds(m, least, seed)
    got = _gather(rounds, fleet, t)
    cohort, plans = got.ctx.cohort, fleet.plans[t]
    assert len(cohort) == m and cohort == sorted(set(cohort))
    segments = cohort_segments(TINY, {d: plans[d].envelope for d in cohort})
    assert all(len(s.members) >= least for s in segments.values()), {s.members for s in segments.values()}
    assert _gather(_rounds(m, least, seed), Fleet(budgets), t).ctx.cohort == cohort  # seeded from (seed, t)
    reveal = rounds.reveal
    tiers = {d: reveal.tier(b) for d, b in fleet.budgets.items()}
    fleet_cap = reveal.cap(tiers.values())
    tiers = {d: min(k, fleet_cap) for d, k in tiers.items()}
    uniform = sample_round_cohort(list(tiers), m, seed, t)
    top = max(tiers[d] for d in uniform)
    if sum(tiers[d] == top for d in uniform) >= least:
        assert cohort == uniform
    if sum(k == top for k in tiers.values()) >= least:
        assert rounds.cap == top  # the highest tier drawn trains its own slices


def test_the_uniform_draw_is_unchanged_where_no_tier_needs_raising_and_plain_runs_keep_it() -> None:
    ids = [f"c{i:02d}" for i in range(20)]
    for t in range(30):
        assert stratified_cohort(ids, dict.fromkeys(ids, 0), 5, 3, 7, t) == sample_round_cohort(ids, 5, 7, t)
        assert sample_round_cohort(ids, 5, 7, t) == [ids[i] for i in sample_cohort(20, 5, round_rng(7, t))]
    plain = RunConcerns.of_keys(rounds=1, per_round=5, seed=0, lr=0.05)
    assert type(SyncRounds(plain, FeastStrategy(MODEL, CACHE), MODEL)) is SyncRounds
    assert released_of(release_of(plain, MODEL, FeastStrategy(MODEL, CACHE))) is None  # no record without secure


@pytest.mark.parametrize(
    "sizes, m, least", [([3, 1, 2], 4, 3), ([3, 4, 1, 2, 1, 1, 1, 1, 6], 5, 3), ([3, 3], 4, 3), ([5, 1, 1, 3], 3, 3)]
)
def test_the_inclusion_probabilities_are_exact(sizes, m, least) -> None:
    """feast_edge.run.cohort.inclusion against 4,000 seeded draws of stratified_cohort (each within 4 standard
    errors); they average m / N over the clients, and a raised tier's exceed it."""
    ids = [f"c{k}-{j}" for k, n in enumerate(sizes) for j in range(n)]
    tiers = {c: 3 * int(c[1 : c.index("-")]) for c in ids}  # not contiguous: only their order counts
    exact = inclusion(sizes, m, least)
    draws = 4000
    counts = [0] * len(sizes)
    for t in range(draws):
        for c in stratified_cohort(ids, tiers, m, least, 1, t):
            counts[tiers[c] // 3] += 1
    for k, n in enumerate(sizes):
        seen = counts[k] / (draws * n)
        assert abs(seen - exact[k]) <= 4 * math.sqrt(exact[k] * (1 - exact[k]) / (draws * n)) + 1e-9, (k, seen)
    assert sum(q * n for q, n in zip(exact, sizes)) == pytest.approx(m)
    assert max(exact) >= m / len(ids) - 1e-12


def test_epsilon_under_stratified_cohorts_is_at_least_a_uniform_draw_s_at_their_largest_inclusion_rate() -> None:
    """A round is accounted at its largest per-device inclusion probability q: never below the ε of a uniform draw at
    rate q (m' of N' with m'/N' <= q), nor below the uniform draw of m of N. Where q N is whole the figure is the
    uniform draw of q N of N itself; the scheduler hands the accountant q through the round's context."""
    dp = DpSettings(1.0, 1.0)
    for sizes, m in [([3, 3], 4), ([3, 4, 1, 2, 1, 1, 1, 1, 6], 5), ([5, 1, 1, 3], 3)]:
        n = sum(sizes)
        q = max(inclusion(sizes, m, 3))
        record = PrivateRounds(dp, ["w"]).check_next([], [], 1, n, [f"c{i}" for i in range(m)], inclusion=q)
        assert record["inclusion"] == q and record["cohort"] == m
        delta = record["delta"]
        stratified = accounted([(n, m, q)] * 5, 1.0, delta).value
        big = 1000 * n  # a uniform draw at rate q, or just below it
        assert stratified >= accounted([(big, math.floor(q * big))] * 5, 1.0, delta).value - 1e-9
        assert stratified > accounted([(n, m)] * 5, 1.0, delta).value
        assert record["epsilon"] == pytest.approx(accounted([(n, m, q)], 1.0, delta).value)
    assert inclusion([3, 3], 4, 3) == [pytest.approx(1 / 3), 1.0]  # three top devices: in every cohort
    assert accounted([(6, 4, 1.0)], 1.0, 1e-5).value == pytest.approx(accounted([(6, 6)], 1.0, 1e-5).value)
    seen: list = []
    fleet = Fleet([0.2e6] * 3 + [1.5e6] * 3)
    _gather(_rounds(4, 3, dp_clip=1.0, dp_noise=1.0), fleet, 0, seen)
    assert seen[0].inclusion == pytest.approx(1.0)  # the scheduler's rate is the draw's exact largest
    seen.clear()
    _gather(_rounds(4, 3), fleet, 0, seen)
    assert seen[0].inclusion is None  # without DP nothing is accounted


def test_what_moved_is_the_released_segments_cells_and_the_served_variants_are_those_whose_every_slice_did() -> None:
    """One round of the six-device fleet uncapped, with the top devices' segment withheld: the variants inside the
    middle tier trained, the ones above did not; the record survives packing; a checkpoint without it is refused."""
    state = MODEL.state_dict()
    updates = []
    for i, budget in enumerate(SIX):
        routed = route_state(state, plan_client(CACHE, budget).layout(TINY, TINY.classes), TINY)
        updates.append((f"d{i}", {k: v + 0.01 if v.is_floating_point() else v for k, v in routed.items()}, 10.0))
    sums = plain_sums(state, updates)
    top = [s for s in sums.sums if set(s.segment.members) == {"d4", "d5"}]
    assert len(top) == 1
    sums.sums.remove(top[0])  # what secure aggregation withholds: two devices, c = 1
    released = Released(state)
    released.add_sums(sums)
    assert trained_variants(TINY, CACHE, released) == frozenset(range(9))
    assert CACHE.largest_servable(1.5e6, range(9)).macs == CACHE.entries[8].macs
    assert CACHE.largest_servable(0.2e6, range(9)).macs == CACHE.entries[0].macs
    with pytest.raises(CacheError, match="run more rounds before serving"):
        CACHE.largest_servable(1.5e6, frozenset())
    again = Released(state)
    again.load(released.tensors())
    assert all(torch.equal(again.moved[n], released.moved[n]) for n in released.moved)
    assert sum(t.numel() for t in released.tensors().values()) * 8 >= sum(b.numel() for b in released.moved.values())
    stage = ReleasedStage(MODEL)
    with pytest.raises(RunError, match="start the run again in another --out"):
        stage.load({}, "checkpoint.safetensors")


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_a_secure_simulation_routes_only_what_it_can_reveal_and_serves_variants_whose_every_slice_trained(
    fashion_mnist_dir, tmp_path, caplog
) -> None:
    """``feast-edge simulate --secure-agg`` on the six-device fleet, c = 1: the start line names variants 9-13, the
    two top clients are routed variants 0-8 only, no segment is withheld, each client is served its largest affordable
    variant whose every slice trained (the top ones variant 8, not 13), and a run resumed after round 1 decides the
    same from its checkpoint."""
    config = tiny_config(
        fashion_mnist_dir, clients=6, per_round=6, rounds=2, train_limit=240, val_samples=50, calib_samples=30,
        test_limit=30, seed=5, budgets=tuple(SIX), secure_agg=True, colluders=1,
    )  # fmt: skip
    sim = Simulation(config, tmp_path / "run")
    plans: dict[int, dict] = {}
    sim.collector.inner.on_start = lambda t, cohort, routed: plans.setdefault(t, dict(routed))
    with caplog.at_level(logging.INFO, logger="feast_edge.run.stratified"):
        results = sim.run()
    assert any("variants 9-13 (0.94M-1.40M MACs) cannot be revealed" in r.getMessage() for r in caplog.records)
    assert all(_indices(plans[t][c]) == list(range(9)) for t in (0, 1) for c in ("client-004", "client-005"))
    assert all(not h.withheld and h.applied for h in sim.history)
    assert results["served"] == [0, 0, 0, 8, 8, 8]
    assert [v["trained"] for v in results["variants"]] == [True] * 9 + [False] * 5
    resumed_dir = tmp_path / "resumed"
    Simulation(config, resumed_dir).run(stop_after=1)
    resumed = Simulation(config, resumed_dir).run(resume=True)
    assert resumed["served"] == results["served"]
    assert [v["trained"] for v in resumed["variants"]] == [v["trained"] for v in results["variants"]]
