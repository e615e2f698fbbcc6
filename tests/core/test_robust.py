"""Robust aggregation over the clients covering each position: clip, trimmed mean, median (issue 9)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.aggregate.robust import (
    NETWORK_MAX_CLIENTS,
    NETWORK_MIN_POSITIONS,
    RULES,
    _comparators,
    clip_updates,
    robust_aggregate,
    update_norm,
)
from feast_edge.aggregate.sparse import PayloadError, aggregate
from feast_edge.run.checkpoint import load_supernet
from feast_edge.settings.nested import SettingsError
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.sim.setup import SimulationConfig, SimulationError
from feast_edge.sim.simulate import CHECKPOINT, Simulation
from feast_edge.space.geometry import envelope_layout
from feast_edge.space.supernet import Supernet
from simconfigs import tiny_config

ROBUST = ("clip", "trimmed-mean", "median")


def _clone(state):
    return {k: v.clone() for k, v in state.items()}


def _shifted(state, seed, scale=0.01):
    """``state`` plus small Gaussian noise on its floating tensors (an honest client's update), counters + 1."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 1 for k, v in state.items()
    }


def _attacked(global_state, honest, factor=1e6):
    """An attacker's payload: an honest client's update ``Δ`` sent as ``factor · Δ``."""
    return {
        k: global_state[k] + factor * (v - global_state[k]) if v.is_floating_point() else v for k, v in honest.items()
    }


@pytest.fixture(scope="module")
def routed(preset, global_state):
    """Five routed payloads of growing envelopes (as a round's cohort returns them), trained a little."""
    top_w = len(preset.width_multipliers) - 1
    payloads = []
    for i in range(5):
        w, d = round(top_w * i / 4), round(preset.max_extra_blocks * i / 4)
        layout = envelope_layout(preset, preset.classes, w, (d,) * preset.num_stages, (w,) * preset.num_stages)
        sliced = Supernet(preset, layout=layout, seed=None).state_dict()
        local = {k: global_state[k][tuple(slice(0, n) for n in v.shape)] for k, v in sliced.items()}
        payloads.append((_shifted(local, i), 40 + 30 * i))
    return payloads


# --------------------------------------------------------------------------- mean and clip are the method §6 average


@pytest.mark.parametrize("inplace", [False, True])
def test_mean_is_aggregate_bit_for_bit(global_state, routed, inplace):
    expected = aggregate(_clone(global_state), routed, inplace=inplace)
    got = robust_aggregate(_clone(global_state), routed, "mean", inplace=inplace)
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_clip_that_scales_nothing_is_the_mean_bit_for_bit(global_state, routed):
    largest = max(update_norm(state, global_state) for state, _ in routed)
    expected = aggregate(global_state, routed)
    got = robust_aggregate(global_state, routed, "clip", clip_norm=largest * 1.01)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_clipping_scales_a_huge_update_to_the_bound_along_its_direction(global_state, routed):
    honest = routed[-1][0]
    norm = update_norm(honest, global_state)
    (clipped, n), (kept, _) = clip_updates(
        global_state, [(_attacked(global_state, honest), 100), routed[0]], clip_norm=2.0 * norm
    )
    assert n == 100 and kept is routed[0][0]  # within the bound: the payload itself
    assert update_norm(clipped, global_state) == pytest.approx(2.0 * norm, rel=1e-4)
    for name, x in clipped.items():  # the attacker's 1e6·Δ comes back as 2·Δ
        if x.is_floating_point():
            base = global_state[name][tuple(slice(0, k) for k in x.shape)]
            torch.testing.assert_close(x - base, 2.0 * (honest[name] - base), rtol=0, atol=1e-3)


def _change(new, global_state):
    return math.sqrt(
        sum(
            float((new[k].double() - global_state[k].double()).square().sum())
            for k in global_state
            if global_state[k].is_floating_point()
        )
    )


def test_clipping_caps_the_influence_of_a_huge_update(global_state):
    honest = [(_shifted(global_state, i), 50) for i in range(4)]
    cohort = [
        *honest,
        (_attacked(global_state, _shifted(global_state, 9)), 500),
    ]  # full routing, the attacker holds most samples
    wrecked = _change(robust_aggregate(global_state, cohort, "mean"), global_state)
    bound = max(update_norm(s, global_state) for s, _ in honest)
    assert wrecked > 1e5 * bound
    for clip_norm in (0.5 * bound, None):  # fixed bound, then adaptive: the cohort's median update norm
        c = clip_norm if clip_norm is not None else float(np.median([update_norm(s, global_state) for s, _ in cohort]))
        # the new global state is a weighted mean of clipped updates, each no longer than c
        assert _change(robust_aggregate(global_state, cohort, "clip", clip_norm=clip_norm), global_state) <= c * (
            1 + 1e-5
        )


# --------------------------------------------------------------------------- coordinate-wise rules against a brute-force reference


def _reference(global_np, clients, rule, trim):
    """Per-position trimmed mean / median over the covering clients, as literally as possible (float64)."""
    out = {}
    for name, g in global_np.items():
        new = g.copy()
        for u in itertools.product(*(range(n) for n in g.shape)):
            values = sorted(
                local[name][u]
                for local in clients
                if name in local and all(i < m for i, m in zip(u, local[name].shape))
            )
            k = len(values)
            if k == 0:
                continue
            if rule == "median":
                new[u] = (values[(k - 1) // 2] + values[k // 2]) / 2
            else:
                t = math.floor(trim * k)
                new[u] = np.mean(values[t : k - t])
        out[name] = new
    return out


@st.composite
def _cohort(draw):
    """A global state of small tensors and up to 9 payloads of leading boxes: nested (FEAST envelopes) or arbitrary."""
    shapes = draw(st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1, max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    global_np = {f"t{i}": rng.normal(size=s) for i, s in enumerate(shapes)}
    m, nested = draw(st.integers(1, 9)), draw(st.booleans())
    clients, last = [], {name: g.shape for name, g in global_np.items()}
    for _ in range(m):
        local = {}
        for name, g in global_np.items():
            if nested or draw(st.booleans()):
                box = tuple(draw(st.integers(1, b)) for b in (last[name] if nested else g.shape))
                local[name] = np.asarray(
                    rng.normal(size=box) * draw(st.sampled_from([1.0, 1e3]))
                )  # some clients far off
                last[name] = box
        clients.append(local)
    return global_np, clients


@settings(max_examples=80, deadline=None)
@given(_cohort(), st.sampled_from(["trimmed-mean", "median"]), st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.34, 0.49]))
def test_coordinate_wise_rules_match_the_brute_force_reference(cohort, rule, trim):
    global_np, clients = cohort
    torch_global = {k: torch.from_numpy(v) for k, v in global_np.items()}
    payloads = [({k: torch.from_numpy(v) for k, v in local.items()}, 1 + i) for i, local in enumerate(clients)]
    expected = _reference(global_np, clients, rule, trim)
    got = robust_aggregate(torch_global, payloads, rule, trim=trim, dtype=torch.float64)
    target = _clone(torch_global)
    in_place = robust_aggregate(target, payloads, rule, trim=trim, dtype=torch.float64, inplace=True)
    for name in global_np:
        np.testing.assert_allclose(got[name].numpy(), expected[name], rtol=1e-12, atol=1e-12)
        assert in_place[name] is target[name] and torch.equal(in_place[name], got[name])
        assert np.array_equal(
            torch_global[name].numpy(), global_np[name]
        )  # not in place: the global state is not written


@pytest.mark.parametrize("rule", ["trimmed-mean", "median"])
def test_large_tensors_sorted_by_the_network_match_the_reference(rule):
    rng = np.random.default_rng(5)
    shape = (4, 70, 60)
    assert np.prod(shape) >= NETWORK_MIN_POSITIONS  # the compare-exchange network sorts this tensor
    boxes = [shape] + [(4 - i // 4, 70 - 6 * i, 60 - 5 * i) for i in range(1, 11)]  # nested, 11 clients
    clients = [{"w": rng.normal(size=box) * (1e3 if i == 3 else 1.0)} for i, box in enumerate(boxes)]
    global_np = {"w": rng.normal(size=shape)}
    got = robust_aggregate(
        {"w": torch.from_numpy(global_np["w"])},
        [({"w": torch.from_numpy(c["w"])}, 1) for c in clients],
        rule,
        trim=0.2,
        dtype=torch.float64,
    )
    np.testing.assert_allclose(got["w"].numpy(), _reference(global_np, clients, rule, 0.2)["w"], rtol=1e-12, atol=1e-12)


def test_the_compare_exchange_network_sorts_every_input():
    """0-1 principle: a comparator network sorts every input iff it sorts every sequence of zeros and ones."""
    rng = np.random.default_rng(0)
    for n in range(1, NETWORK_MAX_CLIENTS + 1):
        bits = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) if n <= 14 else rng.integers(0, 2, size=(20_000, n))
        for a, b in _comparators(n):
            assert a < b < n
            bits[:, a], bits[:, b] = np.minimum(bits[:, a], bits[:, b]), np.maximum(bits[:, a], bits[:, b])
        assert (np.diff(bits, axis=1) >= 0).all(), f"{n} inputs"


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values():
    clients = [({"w": torch.tensor([v])}, 1) for v in (1.0, 2.0, 10.0, 400.0)]
    assert robust_aggregate({"w": torch.zeros(1)}, clients, "median")["w"].item() == 6.0


def test_trimming_starts_at_one_over_trim_covering_clients():
    values = [1.0, 2.0, 3.0, 4.0, 1000.0]
    clients = [({"w": torch.tensor([v])}, 1) for v in values]
    assert robust_aggregate({"w": torch.zeros(1)}, clients, "trimmed-mean", trim=0.1)["w"].item() == pytest.approx(
        np.mean(values)
    )  # ⌊0.5⌋ = 0
    assert robust_aggregate({"w": torch.zeros(1)}, clients, "trimmed-mean", trim=0.2)["w"].item() == pytest.approx(
        3.0
    )  # ⌊1.0⌋ = 1


@pytest.mark.parametrize("rule", ["trimmed-mean", "median"])
@pytest.mark.parametrize(
    "values, expected",
    [
        ((1.0, math.nan, 3.0), 2.0),
        ((math.nan, 5.0), 5.0),
        ((math.nan,), -1.0),  # nobody left: the global value
        (
            (1.0, math.nan, 2.0, 9.0, 3.0),
            2.5,
        ),  # four values: median (2 + 3) / 2; trimmed ⌊0.25·4⌋ = 1 at each end: mean(2, 3)
    ],
)
def test_a_nan_a_client_sends_counts_as_not_covering_the_position(rule, values, expected):
    clients = [({"w": torch.tensor([v, 7.0])}, 1) for v in values]
    assert robust_aggregate({"w": torch.tensor([-1.0, 0.0])}, clients, rule, trim=0.25)["w"].tolist() == [expected, 7.0]


def test_coordinate_wise_rules_ignore_sample_counts():
    clients = [({"w": torch.tensor([0.0])}, 1), ({"w": torch.tensor([1.0])}, 1), ({"w": torch.tensor([2.0])}, 10_000)]
    assert robust_aggregate({"w": torch.zeros(1)}, clients, "median")["w"].item() == 1.0


@pytest.mark.parametrize("rule", ["trimmed-mean", "median"])
def test_an_attacker_moves_median_and_trimmed_mean_only_within_the_honest_range(global_state, rule):
    honest = [(_shifted(global_state, i), 50) for i in range(9)]
    cohort = [*honest, (_attacked(global_state, _shifted(global_state, 99)), 5000)]
    assert _change(robust_aggregate(global_state, cohort, "mean"), global_state) > 1e4
    new = robust_aggregate(global_state, cohort, rule, trim=0.1)  # ⌊0.1·10⌋ = 1 value dropped at each end
    for name, g in global_state.items():
        if g.is_floating_point():
            stacked = torch.stack([s[name] for s, _ in honest])
            assert bool((new[name] >= stacked.amin(0) - 1e-6).all() and (new[name] <= stacked.amax(0) + 1e-6).all()), (
                name
            )


# --------------------------------------------------------------------------- what every rule keeps


@pytest.mark.parametrize("rule", RULES)
def test_uncovered_positions_and_unsent_tensors_keep_their_values_exactly(rule):
    g = {"w": torch.randn(6, 5, 3), "b": torch.randn(6), "untouched": torch.randn(4), "count": torch.tensor(7)}
    clients = [
        ({"w": torch.randn(2, 3, 3), "b": torch.randn(2)}, 10),
        ({"w": torch.randn(4, 2, 3)}, 5),
        ({"w": torch.randn(1, 1, 1)}, 1),
    ]
    new = robust_aggregate(g, clients, rule)
    covered = torch.zeros(6, 5, 3, dtype=torch.bool)
    for state, _ in clients:
        covered[tuple(slice(0, n) for n in state["w"].shape)] = True
    assert torch.equal(new["w"][~covered], g["w"][~covered]) and not torch.equal(new["w"][covered], g["w"][covered])
    assert torch.equal(new["b"][2:], g["b"][2:])
    assert torch.equal(new["untouched"], g["untouched"]) and new["untouched"] is not g["untouched"]
    assert torch.equal(new["count"], g["count"])


@pytest.mark.parametrize("rule", ROBUST)
def test_integer_buffers_are_treated_as_the_mean_rule_treats_them(global_state, routed, rule):
    expected = aggregate(global_state, routed)
    got = robust_aggregate(global_state, routed, rule)
    counters = [k for k, v in global_state.items() if not v.is_floating_point()]
    assert counters and all(torch.equal(got[k], expected[k]) and got[k].dtype == expected[k].dtype for k in counters)
    assert all(got[k].dtype == v.dtype for k, v in global_state.items())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(
    "bad",
    [
        ({"w": torch.zeros(7)}, 5),  # larger than the global tensor
        ({"nope": torch.zeros(2)}, 5),  # not in the global model
        ({"w": torch.zeros(2)}, 0),  # no samples
    ],
)
def test_a_bad_payload_raises_and_changes_nothing(rule, bad):
    g = {"w": torch.arange(6.0), "count": torch.tensor(3)}
    before = _clone(g)
    good = ({"w": torch.full((4,), 100.0), "count": torch.tensor(9)}, 5)
    with pytest.raises(PayloadError):
        robust_aggregate(g, [good, good, bad], rule, inplace=True)
    assert all(torch.equal(g[k], before[k]) for k in g)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rule": "mode"}, "choose one of mean, clip, trimmed-mean, median"),
        ({"rule": "trimmed-mean", "trim": 0.5}, r"must be in \[0, 0.5\)"),
        ({"rule": "clip", "clip_norm": 0.0}, "positive finite L2 bound"),
    ],
)
def test_bad_rule_settings_are_refused_before_anything_runs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        robust_aggregate({"w": torch.zeros(2)}, [({"w": torch.ones(2)}, 1)], **kwargs)
    settings = {"aggregation": kwargs["rule"], **{k: v for k, v in kwargs.items() if k != "rule"}}
    with pytest.raises(SettingsError, match=message):
        RunConcerns.of_keys(rounds=1, per_round=1, **settings)
    with pytest.raises(SimulationError, match=message):
        SimulationConfig.of(**settings)


# --------------------------------------------------------------------------- in a run


def test_the_fingerprint_names_only_the_aggregation_settings_in_use():
    base = SimulationConfig.of()
    assert "aggregation" not in base.decisive() and "trim" not in base.decisive()  # runs from before the rules resume
    assert SimulationConfig.of(aggregation="median").fingerprint() != base.fingerprint()
    assert (
        SimulationConfig.of(aggregation="median", trim=0.3).fingerprint()
        == SimulationConfig.of(aggregation="median").fingerprint()
    )
    assert (
        SimulationConfig.of(aggregation="trimmed-mean", trim=0.3).fingerprint()
        != SimulationConfig.of(aggregation="trimmed-mean").fingerprint()
    )


@pytest.mark.slow
def test_a_median_simulation_completes_and_differs_from_the_mean(tmp_path, fashion_mnist_dir):
    run = tiny_config(fashion_mnist_dir, per_round=3, rounds=1, seed=3, eval_every=5)
    results = Simulation(run.changed(aggregation="median"), tmp_path / "median").run()
    assert results["config"]["aggregation"] == "median" and results["rounds"][0]["applied"]
    Simulation(run, tmp_path / "mean").run(stop_after=1)
    median, mean = (load_supernet(tmp_path / d / CHECKPOINT)[0].state_dict() for d in ("median", "mean"))
    assert all(bool(v.isfinite().all()) for v in median.values() if v.is_floating_point())
    assert any(not torch.equal(median[k], mean[k]) for k in median)
    with pytest.raises(SimulationError, match="differs in: aggregation"):
        Simulation(run, tmp_path / "median").run(resume=True)
