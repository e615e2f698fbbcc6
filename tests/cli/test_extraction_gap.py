"""feast-edge extraction-gap: uncached variants searched, extracted, recalibrated and tested against the cached curve."""

from __future__ import annotations

import json

import numpy as np
import pytest

from feast_edge.evaluate.evaluation import evaluate_variants
from feast_edge.evaluate.extraction import Extracted, curve_at, mean_abs_gap, target_budgets
from feast_edge.run.checkpoint import load_supernet
from feast_edge.sim.setup import build_setup
from feast_edge.sim.simulate import Simulation
from feast_edge.space.arch import Arch
from simconfigs import tiny_config


@pytest.fixture(scope="module")
def feast_run(tmp_path_factory, fashion_mnist_dir):
    out = tmp_path_factory.mktemp("run")
    config = tiny_config(fashion_mnist_dir, rounds=1, train_limit=200, test_limit=200, eval_every=1, seed=1)
    return out, config, Simulation(config, out).run()


@pytest.mark.slow
def test_each_target_gets_a_tested_architecture_and_its_gap_to_the_cached_curve(cli, feast_run):
    out, config, results = feast_run
    macs = sorted(v["macs"] for v in results["variants"])
    low, high = macs[3], macs[12]
    result = cli.run(
        "extraction-gap", str(out), "--points", "3", "--low", str(low), "--high", str(high),
        "--population", "8", "--generations", "3", timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "extraction.json").read_text())
    assert record["range"] == [low, high] and len(record["points"]) == 3 and record["test_samples"] == 200
    cached = [(v["macs"], v["test_accuracy"]) for v in results["variants"]]
    setup = build_setup(config)
    supernet, _ = load_supernet(out / "best.safetensors", setup.preset)
    archs = [Arch.from_dict(p["arch"]) for p in record["points"]]
    again = evaluate_variants(
        supernet, archs, setup.calibration_images(), setup.test_set.images[:200], setup.test_set.labels[:200]
    )
    for point, target, acc in zip(record["points"], target_budgets(low, high, 3), again):
        assert point["target_macs"] == target and point["macs"] <= target
        assert point["accuracy"] == acc  # the arch, its weights and its BN recalibration are what was tested
        assert point["curve"] == pytest.approx(np.interp(point["macs"], *zip(*sorted(cached))))
        assert point["gap"] == pytest.approx(100 * (point["accuracy"] - point["curve"]))
    uncached = [abs(p["gap"]) for p in record["points"] if not p["cached"]]
    assert record["uncached"] == len(uncached)
    assert record["mean_abs_gap"] == (pytest.approx(sum(uncached) / len(uncached)) if uncached else None)
    assert "mean |gap|" in result.stdout


def test_the_curve_interpolates_between_cached_points_and_the_mean_skips_cached_ones():
    cached = [(10, 0.5), (20, 0.7), (40, 0.9)]
    assert curve_at(15, cached) == pytest.approx(0.6) and curve_at(30, cached) == pytest.approx(0.8)
    assert curve_at(20, cached) == pytest.approx(0.7)
    found = [
        Extracted(15, {}, 15, 1, 0.62, 0.6, False),
        Extracted(30, {}, 30, 1, 0.77, 0.8, False),
        Extracted(20, {}, 20, 1, 0.1, 0.7, True),
    ]
    assert mean_abs_gap(found) == pytest.approx(2.5)
    assert mean_abs_gap(found[2:]) is None
    assert target_budgets(10, 40, 4) == [10, 20, 30, 40]


@pytest.mark.slow
def test_bad_runs_and_ranges_are_one_line_errors(cli, feast_run, tmp_path):
    out, _, results = feast_run
    macs = sorted(v["macs"] for v in results["variants"])
    cases = [
        ([str(tmp_path / "none")], "results.json"),
        ([str(out), "--low", str(macs[0] // 2)], "cached range"),
        ([str(out), "--low", str(macs[5]), "--high", str(macs[2])], "low <= high"),
    ]
    other = tmp_path / "heterofl"
    other.mkdir()
    (other / "results.json").write_text(json.dumps({"method": "heterofl", "variants": [], "config": {}}))
    cases.append(([str(other)], "applies to FEAST"))
    for args, message in cases:
        result = cli.invoke("extraction-gap", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], (args, result.stderr)
