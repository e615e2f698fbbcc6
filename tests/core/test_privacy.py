"""Client-level DP on the sparse sum (feast_edge.privacy): exact clipping, noise z·C/n_u per coordinate, the accountant."""

from __future__ import annotations

import math

import dp_accounting
import dp_accounting.pld
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from feast_edge.privacy.accountant import ORDERS, accounted, epsilon_of, local_epsilon, planned_epsilon, round_rdp
from feast_edge.privacy.mechanism import add_sum_noise, noise_generator, private_update, routed_counts
from feast_edge.privacy.private_rounds import BudgetReached, PrivateRounds, check_plan
from feast_edge.privacy.settings import DpSettings, PrivacyError, check_composes, default_delta

PARAMS = {"w", "b"}


def _global() -> dict[str, torch.Tensor]:
    return {
        "w": torch.zeros(40_000),
        "b": torch.ones(3, 4),
        "bn.running_mean": torch.zeros(4),
        "bn.num_batches_tracked": torch.tensor(7),
    }


def test_the_noise_of_a_coordinate_is_z_c_over_the_devices_routed_it():
    """Coordinates of 10, 3 and 1 contributors (leading slices of 10k, 20k, 30k) get std z·C/10, z·C/3, z·C/1; a
    coordinate nobody was routed gets none."""
    glob = _global()
    states = [{"w": torch.zeros(10_000)}] * 7 + [{"w": torch.zeros(20_000)}] * 2 + [{"w": torch.zeros(30_000)}]
    counts = routed_counts(glob, states, ["w"])
    assert counts["w"][:10_000].eq(10).all() and counts["w"][10_000:20_000].eq(3).all()
    assert counts["w"][20_000:30_000].eq(1).all() and counts["w"][30_000:].eq(0).all()
    z, clip = 1.3, 0.7
    add_sum_noise(glob, counts, z * clip, noise_generator(seed=5, t=0))
    w = glob["w"].double()
    for part, n in ((w[:10_000], 10), (w[10_000:20_000], 3), (w[20_000:30_000], 1)):
        expected = z * clip / n
        # 10,000 draws: the sample std is within 3 % of the truth (its relative SE is 0.7 %)
        assert abs(part.std().item() / expected - 1) < 0.03, (n, part.std().item(), expected)
        assert abs(part.mean().item()) < 4 * expected / math.sqrt(part.numel())
    assert w[30_000:].eq(0).all()


def test_dividing_one_average_s_noise_by_the_cohort_would_give_sparse_coordinates_too_little():
    """The issue's arithmetic: with 10 cohort members and 2 routed a coordinate, z·C/10 is 5x below z·C/2."""
    glob = {"w": torch.zeros(2)}
    counts = routed_counts(glob, [{"w": torch.zeros(2)}] * 2 + [{"w": torch.zeros(1)}] * 8, ["w"])
    assert counts["w"].tolist() == [10.0, 2.0]
    assert (1.0 / counts["w"][1]) / (1.0 / 10) == 5


def test_clipping_is_exact_and_keeps_the_direction_and_the_statistics_stay_global():
    glob = _global()
    state = {
        "w": torch.zeros(100),
        "b": torch.ones(3, 2),
        "bn.running_mean": torch.full((4,), 9.0),
        "bn.num_batches_tracked": torch.tensor(99),
    }
    state["w"][:2] = torch.tensor([3.0, 4.0])  # ‖Δ‖ = 5
    clipped, norm = private_update(glob, state, PARAMS, clip=1.0)
    assert norm == pytest.approx(5.0)
    assert clipped["w"][:2].tolist() == pytest.approx([0.6, 0.8], abs=1e-7)
    assert torch.linalg.vector_norm(clipped["w"]).item() == pytest.approx(1.0, abs=1e-6)
    assert clipped["bn.running_mean"].eq(0).all() and clipped["bn.num_batches_tracked"].item() == 7
    small = {"w": torch.full((4,), 0.1), "b": torch.ones(3, 4)}
    kept, norm = private_update(glob, small, PARAMS, clip=1.0)
    assert norm == pytest.approx(0.2) and torch.equal(kept["w"], small["w"])


def test_seeded_noise_repeats_and_unseeded_noise_does_not():
    a = torch.randn(5, generator=noise_generator(3, 1))
    assert torch.equal(a, torch.randn(5, generator=noise_generator(3, 1)))
    assert not torch.equal(a, torch.randn(5, generator=noise_generator(3, 2)))
    assert not torch.equal(
        torch.randn(5, generator=noise_generator(None, 1)), torch.randn(5, generator=noise_generator(None, 1))
    )


def test_one_round_with_every_client_is_the_gaussian_mechanism_of_sensitivity_2c():
    """q = 1: RDP(α) = α / (2 σ²) with σ = z/2 (replacing one client moves the clipped sum by up to 2C)."""
    z = 1.5
    assert np.allclose(round_rdp(10, 10, z), [a / (2 * (z / 2) ** 2) for a in ORDERS])


def test_the_library_reproduces_the_published_dp_sgd_mnist_figure():
    """TensorFlow Privacy's MNIST tutorial: q = 256/60000, z = 1.1, 60 epochs = 14,063 steps, δ = 1e-5: ε ≈ 3.01 with
    the conversion it used (rdp + log(1/δ)/(α−1)); the accountant's tighter conversion can only be lower."""
    accountant = rdp.RdpAccountant(ORDERS)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(1.1)), 14063)
    classic = min(r + math.log(1 / 1e-5) / (a - 1) for a, r in zip(ORDERS, accountant.rdp))
    assert classic == pytest.approx(3.01, abs=0.01)
    assert rdp.compute_epsilon(ORDERS, accountant.rdp, 1e-5)[0] <= classic


def test_epsilon_grows_with_rounds_shrinks_with_noise_and_sampling_helps():
    eps = [planned_epsilon(r, 100, 10, 1.0, 1e-5) for r in (1, 10, 100)]
    assert eps[0] < eps[1] < eps[2]
    assert planned_epsilon(10, 100, 10, 2.0, 1e-5) < eps[1]
    assert planned_epsilon(10, 100, 10, 1.0, 1e-5) < planned_epsilon(10, 10, 10, 1.0, 1e-5)  # 10 of 100 vs all
    assert epsilon_of([(100, 10)] * 5 + [(50, 10)] * 5, 1.0, 1e-5) > planned_epsilon(10, 100, 10, 1.0, 1e-5)
    assert epsilon_of([], 1.0, 1e-5) == 0.0


def test_local_dp_accounts_the_client_that_took_part_most_without_amplification():
    rounds = PrivateRounds(DpSettings(1.0, 1.0, mode="local"), PARAMS)
    eps = rounds.epsilon([(100, 2)] * 3, [["a", "b"], ["a", "c"], ["a", "d"]], 1e-5)
    assert eps.value == pytest.approx(epsilon_of([(1, 1)] * 3, 1.0, 1e-5, "local"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip": 0.0, "noise": 1.0}, "--dp-clip 0.0 must be a positive L2 norm"),
        ({"clip": -1.0, "noise": 1.0}, "--dp-clip -1.0"),
        ({"clip": 1.0, "noise": 0.0}, "--dp-noise 0.0 must be a positive noise multiplier"),
        ({"clip": 1.0, "noise": -2.0}, "--dp-noise -2.0"),
        ({"clip": 1.0, "noise": float("nan")}, "--dp-noise nan"),
        ({"clip": 1.0, "noise": 1.0, "delta": 1.0}, "--dp-delta 1.0 must lie in"),
        ({"clip": 1.0, "noise": 1.0, "epsilon": 0.0}, "--dp-epsilon 0.0"),
        ({"clip": 1.0, "noise": 1.0, "mode": "shuffle"}, "--dp-mode 'shuffle'"),
    ],
)
def test_bad_settings_name_the_option(kwargs, message):
    with pytest.raises(PrivacyError, match=message.replace("(", r"\(").replace(".", r"\.")):
        DpSettings(**kwargs)


def test_delta_must_stay_below_one_over_the_population():
    dp = DpSettings(1.0, 1.0, delta=0.01)
    with pytest.raises(PrivacyError, match=r"--dp-delta 0\.01 is not below 1/population = 1/100"):
        dp.resolved_delta(100)
    assert dp.resolved_delta(50) == 0.01
    assert DpSettings(1.0, 1.0).resolved_delta(100) == default_delta(100) == 1e-5
    assert default_delta(1_000_000) == pytest.approx(1e-7)


def test_robust_rules_and_methods_that_do_not_average_slices_are_refused():
    for rule in ("median", "trimmed-mean", "clip"):
        with pytest.raises(PrivacyError, match=f"--aggregation {rule} does not compose"):
            check_composes(rule, True, "feast")
    with pytest.raises(PrivacyError, match="method sfn does not aggregate by averaging routed slices"):
        check_composes("mean", False, "sfn")
    check_composes("mean", True, "heterofl")


def test_a_plan_past_the_budget_is_refused_with_the_rounds_that_fit():
    dp = DpSettings(1.0, 1.0, epsilon=10.0)
    fits = max(r for r in range(1, 50) if planned_epsilon(r, 100, 10, 1.0, 1e-5) <= 10.0)
    with pytest.raises(PrivacyError, match=rf"the planned 50 rounds .* reach ε = .*; {fits} rounds fit the budget"):
        check_plan(dp, 50, 100, 10)
    assert check_plan(dp, fits, 100, 10) <= 10.0


def test_a_round_that_would_pass_the_budget_is_refused_before_it_runs():
    rounds = PrivateRounds(DpSettings(1.0, 1.0, epsilon=planned_epsilon(2, 100, 10, 1.0, 1e-5) * 1.001), PARAMS)
    first = rounds.check_next([], [], 1, 100, list("abcdefghij"))
    second = rounds.check_next([first], [list("abcdefghij")], 2, 100, list("abcdefghij"))
    assert first["delta"] == 1e-5 and first["epsilon"] < second["epsilon"]
    with pytest.raises(BudgetReached, match=r"round 3 would bring ε to .* stopped after round 2 at ε = "):
        rounds.check_next([first, second], [list("abcdefghij")] * 2, 3, 100, list("abcdefghij"))


def test_the_dashboard_history_carries_a_round_s_epsilon_and_only_under_dp():
    from feast_edge.dashboard.runs import history_entry

    private = history_entry({"round": 2, "dp": {"population": 100, "cohort": 10, "epsilon": 4.5, "delta": 1e-5}})
    assert private["epsilon"] == 4.5 and private["delta"] == 1e-5
    assert "epsilon" not in history_entry({"round": 2}) and "epsilon" not in history_entry({"round": 2, "dp": {}})


# --- the tighter accountant: PLD of the dominating pair ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("population", "cohort", "noise", "rounds", "expected"),
    [(100, 10, 1.0, 8, 11.4), (1000, 100, 1.0, 40, 20.5)],  # the worst cases an independent recomputation found
)
def test_epsilon_is_the_pld_figure_of_the_dominating_pair_within_5_percent_of_the_true_worst_case(
    population, cohort, noise, rounds, expected
):
    eps = accounted([(population, cohort)] * rounds, noise, 1e-5)
    assert eps.accountant == "pld" and eps.value == eps.pld < eps.rdp
    assert eps.value == pytest.approx(expected, rel=0.05)
    # dp-accounting's PLD of Poisson sampling at q = m/N of the Gaussian z/2 under add/remove, composed directly.
    direct = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
    direct.compose(
        dp_accounting.PoissonSampledDpEvent(cohort / population, dp_accounting.GaussianDpEvent(noise / 2)), rounds
    )
    assert (
        eps.value == pytest.approx(direct.get_epsilon(1e-5), rel=1e-3) and eps.value >= direct.get_epsilon(1e-5) - 1e-6
    )


@pytest.mark.parametrize(
    ("population", "cohort", "noise", "rounds"),
    [(100, 10, 1.0, 8), (1000, 100, 1.0, 40), (100, 10, 2.0, 8), (50, 5, 1.5, 30)],
)
def test_epsilon_agrees_with_an_independent_accountant(population, cohort, noise, rounds):
    """Microsoft's prv-accountant (Gopi, Lee, Wutschitz 2021), another implementation of the same pair's composition."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    prv = PoissonSubsampledGaussianMechanism(sampling_probability=cohort / population, noise_multiplier=noise / 2)
    low, estimate, high = PRVAccountant(
        prvs=[prv], max_self_compositions=[rounds], eps_error=0.1, delta_error=1e-9
    ).compute_epsilon(delta=1e-5, num_self_compositions=[rounds])
    ours = epsilon_of([(population, cohort)] * rounds, noise, 1e-5)
    assert low - 0.01 <= ours <= high + 0.01, (low, estimate, high, ours)


def test_without_sampling_the_pld_is_the_gaussian_mechanism():
    """q = 1 (local DP, or whoever sees the cohorts): the composition of T Gaussians z/2 is one Gaussian z/(2√T), whose
    exact δ(ε) (Balle and Wang 2018) the figure must meet."""
    from scipy.stats import norm

    noise, rounds, eps = 1.0, 3, local_epsilon([1.0] * 3, 1e-5)
    mu = 2 * math.sqrt(rounds) / noise  # sensitivity over the composed Gaussian's σ
    delta = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    assert delta == pytest.approx(1e-5, rel=0.02) and delta <= 1e-5 * 1.0001
    assert eps < accounted([(1, 1)] * rounds, noise, 1e-5, "local").rdp  # RDP's conversion is looser here too


def test_the_budget_check_uses_the_tighter_figure():
    rdp_only = accounted([(100, 10)] * 8, 1.0, 1e-5)
    dp = DpSettings(1.0, 1.0, epsilon=(rdp_only.pld + rdp_only.rdp) / 2)  # PLD fits, RDP would not
    assert check_plan(dp, 8, 100, 10) == pytest.approx(rdp_only.pld)
    rounds = PrivateRounds(dp, PARAMS)
    record = rounds.check_next([], [], 1, 100, list("abcdefghij"))
    assert record["accountant"] == "pld" and record["epsilon"] == accounted([(100, 10)], 1.0, 1e-5).value


def test_a_history_recorded_with_rdp_only_says_so():
    from feast_edge.privacy.private_rounds import privacy_line, privacy_summary

    dp = DpSettings(1.0, 1.0)
    old = [{"population": 100, "cohort": 10, "epsilon": 5.0, "delta": 1e-5}]
    assert (
        "recorded by an earlier feast-edge, which accounted with RDP only"
        in privacy_summary(dp, old, None)["accountant"]
    )
    resumed = [*old, {"population": 100, "cohort": 10, "epsilon": 4.0, "delta": 1e-5, "accountant": "pld"}]
    block = privacy_summary(dp, resumed, None)
    assert (
        block["accountant"].startswith("dp-accounting PLD")
        and "rounds 1-1 recorded with RDP only" in block["accountant"]
    )
    both = accounted([(100, 10)] * 2, 1.0, 1e-5)
    assert block["epsilon_by"] == {"rdp": both.rdp, "pld": both.pld}
    assert f"ε = 4 (PLD; RDP: {both.rdp:.3g}) at δ = 1e-05 after 2 rounds" in privacy_line(block)
