"""Adaptive clipping under central DP (feast_edge.privacy): a private count moves the bound toward a quantile of the
update norms, and the count's noise is paid for by the updates' so ε stays that of ``--dp-noise``."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feast_edge.privacy.mechanism import COUNT, next_clip, noise_generator, noised_unclipped
from feast_edge.privacy.private_rounds import PrivateRounds, privacy_line, privacy_summary
from feast_edge.privacy.settings import COUNT_SHARE, DpSettings, PrivacyError, dp_of

PARAMS = {"w"}


def _update(norm: float) -> dict[str, torch.Tensor]:
    """A change of L2 norm ``norm`` from the zero global state, plus a BN statistic the device must not send."""
    w = torch.zeros(100)
    w[0], w[1] = 0.6 * norm, 0.8 * norm
    return {"w": w, "bn.running_mean": torch.full((4,), 5.0)}


GLOBAL = {"w": torch.zeros(100), "bn.running_mean": torch.zeros(4)}


def test_the_count_and_the_updates_together_are_one_gaussian_of_multiplier_z():
    dp = DpSettings(1.0, 1.2, clip_quantile=0.5)
    # Default: COUNT_SHARE of 1/z² goes to the count (sensitivity 1/2 of the centred bits), the rest to the updates.
    assert (2 * dp.count_std()) ** -2 == pytest.approx(COUNT_SHARE / 1.2**2)
    assert dp.update_noise() ** -2 + (2 * dp.count_std()) ** -2 == pytest.approx(1.2**-2)
    given = DpSettings(1.0, 1.0, clip_quantile=0.5, clip_count_std=5.0)
    assert given.count_std() == 5.0 and given.update_noise() == pytest.approx((1 - 0.01) ** -0.5)
    assert DpSettings(1.0, 1.2).update_noise() == 1.2  # a fixed bound spends nothing on a count


def test_the_noised_fraction_is_unbiased_with_std_sigma_over_m():
    norms = [0.2, 0.4, 0.9, 1.5, 3.0]  # 3 of 5 within the bound 1.0
    draws = np.array([noised_unclipped(norms, 1.0, 2.0, noise_generator(7, t, COUNT)) for t in range(4000)])
    assert draws.mean() == pytest.approx(0.6, abs=4 * 0.4 / math.sqrt(4000))
    assert draws.std() == pytest.approx(2.0 / 5, rel=0.05)
    assert noised_unclipped(norms, 1.0, 1e-12, noise_generator(7, 0, COUNT)) == pytest.approx(0.6)


def test_the_bound_shrinks_when_too_many_go_unclipped_and_grows_when_too_few():
    assert next_clip(2.0, 0.9, 0.5, 0.2) == pytest.approx(2.0 * math.exp(-0.08))
    assert next_clip(2.0, 0.1, 0.5, 0.2) == pytest.approx(2.0 * math.exp(0.08))
    assert next_clip(2.0, 0.5, 0.5, 0.2) == 2.0


def test_rounds_move_the_bound_to_the_target_quantile_of_the_update_norms():
    """Norms 1..10 every round; from C = 50 the bound settles where about a quarter of them go unclipped."""
    dp = DpSettings(50.0, 0.2, seed=3, clip_quantile=0.25, clip_count_std=0.2)
    rounds = PrivateRounds(dp, PARAMS)
    updates = [(f"c{i}", _update(float(i))) for i in range(1, 11)]
    history, clients = [], [c for c, _ in updates]
    for t in range(60):
        record = rounds.check_next(history, [clients] * t, t + 1, 10, clients)
        states = rounds.privatize(GLOBAL, updates, t, record)
        assert all(torch.linalg.vector_norm(s["w"]) <= record["clip"] * (1 + 1e-6) for s in states)
        assert all(torch.equal(s["bn.running_mean"], GLOBAL["bn.running_mean"]) for s in states)
        history.append(record)
    settled = [h["clip"] for h in history[-20:]]
    assert history[0]["clip"] == 50.0 and 1.5 < np.median(settled) < 4.5  # the 0.25 quantile of 1..10 lies in (2, 3]
    assert [h["clip"] for h in history[1:]] == [h["next_clip"] for h in history[:-1]]  # each round uses the last's


def test_the_updates_noise_uses_the_round_s_bound_and_the_larger_multiplier():
    dp = DpSettings(1.0, 1.0, seed=5, clip_quantile=0.5)
    state = {"w": torch.zeros(200_000)}
    rounds = PrivateRounds(dp, PARAMS)
    rounds.noise(state, [{"w": torch.zeros(200_000)}], 0, {"clip": 3.0})
    assert state["w"].std().item() == pytest.approx(dp.update_noise() * 3.0, rel=0.01)


def test_adaptive_clipping_keeps_the_epsilon_of_its_noise_and_is_summarised():
    fixed, adaptive = DpSettings(1.0, 1.0), DpSettings(1.0, 1.0, clip_quantile=0.5)
    a, b = PrivateRounds(fixed, PARAMS), PrivateRounds(adaptive, PARAMS)
    cohort = [f"c{i}" for i in range(10)]
    assert a.check_next([], [], 1, 100, cohort)["epsilon"] == b.check_next([], [], 1, 100, cohort)["epsilon"]
    records = [{"population": 100, "cohort": 10, "epsilon": 0.5, "delta": 1e-5, "clip": 1.0, "next_clip": 0.8},
               {"population": 100, "cohort": 10, "epsilon": 0.7, "delta": 1e-5, "clip": 0.8, "next_clip": 0.7}]  # fmt: skip
    block = privacy_summary(adaptive, records, None)
    assert block["adaptive_clip"] | {} == {
        "quantile": 0.5,
        "lr": 0.2,
        "count_std": adaptive.count_std(),
        "update_noise": adaptive.update_noise(),
        "first": 1.0,
        "last": 0.8,
        "next": 0.7,
    }
    assert "adaptive clip toward the 0.5 quantile of update norms, C = 1 → 0.8" in privacy_line(block)
    assert "adaptive_clip" not in privacy_summary(fixed, records, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_quantile": 1.0}, "--dp-clip-quantile 1.0 must be a fraction in (0, 1)"),
        ({"clip_quantile": 0.0}, "--dp-clip-quantile 0.0"),
        ({"clip_quantile": 0.5, "clip_lr": 0.0}, "--dp-clip-lr 0.0 must be a positive step"),
        ({"clip_quantile": 0.5, "clip_count_std": 0.5}, "--dp-clip-count-std 0.5 must exceed --dp-noise / 2 = 0.5"),
        ({"clip_quantile": 0.5, "mode": "local"}, "--dp-clip-quantile works with --dp-mode central only"),
    ],
)
def test_bad_adaptive_settings_name_the_option(kwargs, message):
    with pytest.raises(PrivacyError, match=re.escape(message)):
        DpSettings(1.0, 1.0, **kwargs)


def _options(**given):
    fields = dict(dp_clip=1.0, dp_noise=1.0, dp_delta=None, dp_epsilon=None, dp_seed=None, dp_mode="central",
                  dp_clip_quantile=None, dp_clip_lr=0.2, dp_clip_count_std=None)  # fmt: skip
    return SimpleNamespace(**(fields | given))


def test_the_options_go_together_or_are_refused():
    assert dp_of(_options(dp_clip_quantile=0.3)).clip_quantile == 0.3
    with pytest.raises(PrivacyError, match="--dp-clip-lr and --dp-clip-count-std tune adaptive clipping"):
        dp_of(_options(dp_clip_lr=0.5))
    with pytest.raises(PrivacyError, match="--dp-clip-quantile needs --dp-clip and --dp-noise"):
        dp_of(_options(dp_clip=None, dp_noise=None, dp_clip_quantile=0.5))
    # A fixed bound keeps the fingerprint it had before adaptive clipping existed.
    assert set(DpSettings(1.0, 1.0).settings()["dp"]) == {"clip", "noise", "delta", "epsilon", "seed", "mode"}
    assert DpSettings(1.0, 1.0, clip_quantile=0.5).settings()["dp"]["clip_quantile"] == 0.5
