"""Versions: the install gate (the served-round rule's test on paired held-out outcomes), the canary draw across
budget tiers and its promotion rule (liar bound, majority), and the versions registry surviving a reopen."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from feast_edge.evaluate.coverage import SERVE_MARGIN, SERVE_Z
from feast_edge.versions.book import VersionBook, weights_digest
from feast_edge.versions.canary import budget_tiers, draw_canaries, judge_canaries
from feast_edge.versions.gate import FIRST, INSTALLED, REFUSED, ROLLED_BACK, from_counts, judge


def _outcomes(n: int, correct: int, rng: np.random.Generator) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[rng.permutation(n)[:correct]] = True
    return out


def test_a_version_worse_by_more_than_the_served_round_rules_margin_is_refused() -> None:
    rng = np.random.default_rng(0)
    old = _outcomes(1000, 800, rng)
    new = old.copy()
    new[np.flatnonzero(old)[:150]] = False  # 65% against 80%, on the same examples
    verdict = judge(new, old)
    assert not verdict.install and verdict.decision == REFUSED
    assert (verdict.examples, verdict.new_correct, verdict.old_correct) == (1000, 650, 800)
    assert (verdict.new_only, verdict.old_only) == (0, 150)
    # The threshold is the served-round rule's: 2 points, or 2 standard errors of the difference.
    se = math.sqrt(0.8 * 0.2 / 1000 + 0.65 * 0.35 / 1000)
    assert verdict.threshold == pytest.approx(max(SERVE_MARGIN, SERVE_Z * se))
    assert "refused: 65.0% vs 80.0% running, paired on 1000 held-out examples" in verdict.words()


def test_a_version_within_noise_or_better_is_installed() -> None:
    rng = np.random.default_rng(1)
    old = _outcomes(200, 140, rng)
    new = old.copy()
    new[np.flatnonzero(old)[:5]] = False  # 2.5 points down on 200 examples: within two standard errors
    assert judge(new, old).install
    better = old | _outcomes(200, 100, rng)
    verdict = judge(better, old)
    assert verdict.install and verdict.decision == INSTALLED and verdict.difference > 0


def test_the_gate_takes_paired_vectors_of_one_length() -> None:
    with pytest.raises(ValueError, match="paired outcomes"):
        judge([True, False], [True])
    assert judge([], []).install  # nothing to compare on: installed, not compared


def test_budget_tiers_keep_equal_budgets_together_and_canaries_cover_every_tier() -> None:
    budgets = {f"d{i:02d}": [2, 6, 12, 40][i % 4] * 10**6 for i in range(20)}
    tiers = budget_tiers(budgets)
    assert sorted(set(tiers.values())) == [0, 1, 2, 3]
    assert all(tiers[d] == [2, 6, 12, 40].index(budgets[d] // 10**6) for d in budgets)
    for version in range(1, 30):
        canaries = draw_canaries(budgets, 0.2, seed=7, version=version)
        assert len(canaries) == 4
        assert {tiers[d] for d in canaries} == {0, 1, 2, 3}
        assert canaries == draw_canaries(budgets, 0.2, seed=7, version=version)  # a restarted server draws the same
    assert len(draw_canaries(budgets, 0.5, seed=7, version=1)) == 10
    assert len({draw_canaries(budgets, 0.2, seed=7, version=v) for v in range(1, 30)}) > 1  # the burden moves
    assert draw_canaries(budgets, 0.0, seed=7, version=1) == ()
    one = {"a": 5, "b": 5, "c": 5}
    assert len(draw_canaries(one, 0.2, 0, 1)) == 1  # one tier, share below one device: one canary


def _verdict(old: int, new: int, n: int = 500):
    both = min(old, new)
    return from_counts(n, new, old, new - both, old - both)


def test_canaries_that_regress_hold_a_version_back_and_one_liar_cannot() -> None:
    honest_fine = {"a": _verdict(400, 405), "b": _verdict(380, 381), "c": _verdict(300, 310)}
    assert judge_canaries(honest_fine).promote
    # A liar claiming a collapse beside three honest canaries: bounded by the others' range, the version goes on.
    lied = judge_canaries({**honest_fine, "liar": _verdict(450, 10)})
    assert lied.promote and "liar's figures bounded" in lied.reason
    # Most canaries regress: held back, with the figures.
    held = judge_canaries({"a": _verdict(400, 250), "b": _verdict(380, 200), "c": _verdict(300, 301)})
    assert not held.promote and held.regressed == ("a", "b", "c")  # c alone cannot clear it: bounded
    assert (
        "held back: it regressed on 2 of 3 canaries (a 80.0% -> 50.0%, b 76.0% -> 40.0%); c's figures bounded"
        in held.reason
    )
    # A liar claiming all is well cannot promote what the honest canaries saw regress.
    assert not judge_canaries(
        {"a": _verdict(400, 250), "b": _verdict(380, 200), "c": _verdict(390, 220), "liar": _verdict(10, 450)}
    ).promote
    # The served-round rule's distrusted devices do not vote.
    assert judge_canaries({"a": _verdict(400, 250), "b": _verdict(380, 381)}, distrusted={"a"}).promote
    # A single canary that regressed holds it.
    assert not judge_canaries({"a": _verdict(400, 250)}).promote
    assert judge_canaries({}).promote  # none compared: nothing to hold it on


def test_the_versions_registry_records_every_decision_and_survives_a_reopen(tmp_path) -> None:
    path = tmp_path / "versions.sqlite"
    book = VersionBook(path)
    one = book.add(round=4, reason="r4", weights_sha256="a" * 64, state="direct", at=100.0)
    two = book.add(round=8, reason="r8", weights_sha256="b" * 64, state="canary", canaries=("d2",), average_of=(7, 8))
    assert (one.number, two.number) == (1, 2)
    book.record("d1", 1, "offered", at=101.0)
    book.record("d1", 1, FIRST, running=1, at=102.0)
    book.record("d2", 1, "offered")
    book.record("d2", 1, FIRST, running=1, at=103.0)
    book.record("d2", 2, "offered")
    refused = _verdict(400, 250)
    book.record("d2", 2, REFUSED, figures=refused.figures(), running=1, reason="worse here")
    book.decide(2, "held", "held back: ...")
    book.record("d1", 2, "offered")
    book.record("d1", 2, INSTALLED, figures=_verdict(300, 330).figures(), running=2, at=110.0)
    book.record("d1", 2, ROLLED_BACK, running=1, at=120.0)
    book.close()
    again = VersionBook(path, readonly=True)
    assert [v.number for v in again.versions()] == [1, 2]
    assert again.version(2).state == "held" and again.version(2).average_of == (7, 8)
    assert again.version(2).canaries == ("d2",)
    assert again.answers(2)["d2"].verdict() == refused  # the figures, recomputed from the counts
    assert again.offered(2) == {"d1", "d2"}
    running = again.running()
    assert running["d2"].version == 1 and running["d2"].since == 103.0
    assert running["d1"].version == 1 and running["d1"].since == 120.0  # rolled back by hand
    assert again.counts()["offered"] == 4
    again.close()


def test_the_weights_digest_is_the_tensors_not_their_order() -> None:
    a = {"x": torch.ones(3), "y": torch.zeros(2)}
    b = {"y": torch.zeros(2), "x": torch.ones(3)}
    assert weights_digest(a) == weights_digest(b)
    assert weights_digest(a) != weights_digest({"x": torch.ones(3), "y": torch.ones(2)})


def test_a_device_rolled_back_to_a_model_from_before_the_runs_versions_runs_none_of_them() -> None:
    book = VersionBook(":memory:")
    book.add(round=2, reason="r2", weights_sha256="c" * 64, state="direct")
    book.record("d", 1, "installed", figures=_verdict(300, 320).figures(), running=1)
    assert book.running()["d"].version == 1 and book.running()["d"].accuracy == 0.64
    book.record("d", 1, ROLLED_BACK, running=None)
    assert "d" not in book.running()
