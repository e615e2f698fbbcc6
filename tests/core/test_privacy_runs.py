"""DP in a whole run (feast-edge simulate): uniform weights, ε per round, exact resume, the budget, bad input refused."""

from __future__ import annotations

import csv
import json
from dataclasses import replace

import pytest
import torch

from feast_edge.privacy.accountant import planned_epsilon
from feast_edge.privacy.private_rounds import PrivateRounds
from feast_edge.privacy.settings import DpSettings
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.stages.privacy_noise import PrivacyStage
from feast_edge.sim.setup import SimulationError
from feast_edge.sim.simulate import CHECKPOINT, Simulation
from simconfigs import cli_options, tiny_config

DP_RUN = tiny_config(rounds=3, seed=3, eval_every=3, dp_clip=0.5, dp_noise=0.8, dp_seed=11)


@pytest.fixture(scope="module")
def private(tmp_path_factory, fashion_mnist_dir):
    out = tmp_path_factory.mktemp("dp")
    return out, Simulation(DP_RUN, out).run()


@pytest.mark.slow
def test_every_round_has_uniform_weights_and_its_epsilon_in_the_csv_and_the_results(private):
    out, results = private
    rounds = results["rounds"]
    assert [r["samples"] for r in rounds] == [len(r["updated"]) for r in rounds] and all(
        not r["capped"] for r in rounds
    )
    eps = [r["dp"]["epsilon"] for r in rounds]
    assert eps == sorted(eps) and eps[0] > 0
    assert eps[-1] == pytest.approx(
        planned_epsilon(3, DP_RUN.population.clients, DP_RUN.population.per_round, 0.8, 1e-5)
    )
    assert [float(row["epsilon"]) for row in csv.DictReader((out / "rounds.csv").open())] == pytest.approx(eps, 1e-4)
    block = results["privacy"]
    assert block["epsilon"] == eps[-1] and block["delta"] == 1e-5 and block["weights"] == "uniform"
    assert block["stopped"] is None and block["noise_seed"] == 11
    # Against whoever sees who was sampled: every round at q = 1, a larger ε.
    assert block["epsilon_without_sampling"] == pytest.approx(planned_epsilon(3, 2, 2, 0.8, 1e-5))
    assert block["epsilon_without_sampling"] > block["epsilon"]


@pytest.mark.slow
def test_a_resumed_private_run_continues_the_noise_and_the_accounting_exactly(private, tmp_path):
    full_out, full = private
    assert Simulation(DP_RUN, tmp_path).run(stop_after=2) is None
    resumed = Simulation(DP_RUN, tmp_path).run(resume=True)
    a, b = load_supernet(full_out / CHECKPOINT)[0].state_dict(), load_supernet(tmp_path / CHECKPOINT)[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["dp"] for r in resumed["rounds"]] == [r["dp"] for r in full["rounds"]]


@pytest.mark.slow
def test_noise_changes_the_model_and_a_resume_with_other_dp_settings_is_refused(private, tmp_path):
    full_out, _ = private
    Simulation(DP_RUN.changed(rounds=1), tmp_path / "a").run()
    Simulation(DP_RUN.changed(rounds=1, dp_seed=12), tmp_path / "b").run()
    a, b = (load_supernet(tmp_path / d / CHECKPOINT)[0].state_dict() for d in "ab")
    assert any(not torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point())
    with pytest.raises(SimulationError, match=r"other settings \(differs in: dp\)"):
        Simulation(DP_RUN.changed(dp_noise=1.0), full_out).run(resume=True)


@pytest.mark.slow
def test_the_run_stops_before_the_round_that_would_pass_the_budget(fashion_mnist_dir, tmp_path):
    sim = Simulation(DP_RUN, tmp_path)
    budget = (
        planned_epsilon(1, DP_RUN.population.clients, DP_RUN.population.per_round, 0.8, 1e-5) * 1.01
    )  # round 1 fits, round 2 does not
    [stage] = [s for s in sim.loop.release.stages if isinstance(s, PrivacyStage)]
    stage.rounds = PrivateRounds(replace(DP_RUN.dp_settings(), epsilon=budget), stage.rounds.params)
    results = sim.run()
    assert len(results["rounds"]) == 1
    assert (
        "round 2 would bring ε to" in results["privacy"]["stopped"]
        and "stopped after round 1" in results["privacy"]["stopped"]
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dp_noise": 1.0}, "needs both --dp-clip C and --dp-noise z"),
        ({"dp_clip": 1.0, "dp_noise": 0.0}, "--dp-noise 0.0 must be a positive noise multiplier"),
        ({"dp_clip": 0.0, "dp_noise": 1.0}, "--dp-clip 0.0 must be a positive L2 norm"),
        ({"dp_epsilon": 3.0}, "--dp-epsilon needs --dp-clip and --dp-noise"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_delta": 0.3}, r"--dp-delta 0\.3 is not below 1/population = 1/4"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "aggregation": "median"}, "--aggregation median does not compose"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "max_weight_ratio": 3.0}, "drop --max-weight-ratio"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "method": "sfn"}, "method sfn does not aggregate by averaging"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_epsilon": 0.5}, r"--dp-epsilon 0\.5: the planned 2 rounds"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_clip_quantile": 2.0}, r"--dp-clip-quantile 2\.0 must be a fraction"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_clip_lr": 0.1}, "need --dp-clip-quantile"),
        (
            {"dp_clip": 1.0, "dp_noise": 1.0, "dp_clip_quantile": 0.5, "dp_mode": "local"},
            "works with --dp-mode central only",
        ),
    ],
)
def test_bad_dp_settings_are_refused_before_anything_runs(changes, message):
    with pytest.raises(SimulationError, match=message):
        tiny_config(**changes)


def test_the_command_line_refuses_a_bad_setting_in_one_line_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "run"
    result = cli.invoke(
        "simulate", *cli_options(tiny_config()), "--out", str(out), "--dp-clip", "1", "--dp-noise", "-1"
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--dp-noise -1.0 must be a positive noise multiplier" in result.stderr + result.stdout
    assert not out.exists()


def test_dp_settings_enter_the_fingerprint_only_when_dp_is_on():
    plain = tiny_config()
    assert "dp" not in plain.decisive() and plain.dp_settings() is None
    assert tiny_config(dp_clip=1.0, dp_noise=1.0).decisive()["dp"] == DpSettings(1.0, 1.0).settings()["dp"]


@pytest.mark.slow
def test_the_report_puts_accuracy_against_epsilon_beside_a_run_without_dp(private, tmp_path, cli):
    out, results = private
    plain = tmp_path / "plain"
    Simulation(DP_RUN.changed(dp_clip=None, dp_noise=None, dp_seed=None), plain).run()
    result = cli.invoke("report", str(out), str(plain), "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    section = text[text.index("## Privacy") :]
    assert "dp z=0.8 C=0.5" in section and "| no DP |" in section.replace("  ", " ")
    assert f"{results['privacy']['epsilon']:.3g}" in section and "∞" in section
    assert (tmp_path / "report" / "privacy.png").stat().st_size > 10_000


ADAPTIVE_RUN = DP_RUN.changed(dp_clip_quantile=0.5, dp_clip_lr=0.5)


@pytest.mark.slow
def test_adaptive_clipping_moves_the_bound_in_the_csv_and_a_resume_continues_it_exactly(fashion_mnist_dir, tmp_path):
    full = Simulation(ADAPTIVE_RUN, tmp_path / "full").run()
    clips = [r["dp"]["clip"] for r in full["rounds"]]
    assert clips[0] == 0.5 and clips[1:] == [r["dp"]["next_clip"] for r in full["rounds"][:-1]]
    assert len(set(clips)) == 3  # the bound moved every round
    rows = list(csv.DictReader((tmp_path / "full" / "rounds.csv").open()))
    assert [float(row["clip"]) for row in rows] == pytest.approx(clips, 1e-5)
    # The count costs no ε: the same accounting as a fixed bound of the same --dp-noise.
    assert full["privacy"]["epsilon"] == pytest.approx(
        planned_epsilon(3, DP_RUN.population.clients, DP_RUN.population.per_round, 0.8, 1e-5)
    )
    assert full["privacy"]["adaptive_clip"]["last"] == clips[-1]
    assert Simulation(ADAPTIVE_RUN, tmp_path / "resumed").run(stop_after=2) is None
    resumed = Simulation(ADAPTIVE_RUN, tmp_path / "resumed").run(resume=True)
    assert [r["dp"] for r in resumed["rounds"]] == [r["dp"] for r in full["rounds"]]
    a, b = (load_supernet(tmp_path / d / CHECKPOINT)[0].state_dict() for d in ("full", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SimulationError, match=r"other settings \(differs in: dp\)"):
        Simulation(ADAPTIVE_RUN.changed(dp_clip_quantile=0.3), tmp_path / "full").run(resume=True)


@pytest.mark.slow
def test_simulate_prints_the_adaptive_bound_s_path_on_its_privacy_line(cli, fashion_mnist_dir, tmp_path):
    out = tmp_path / "run"
    options = ["--dp-clip", "0.5", "--dp-noise", "0.8", "--dp-clip-quantile", "0.5", "--dp-seed", "3"]
    result = cli.invoke("simulate", *cli_options(tiny_config()), "--out", str(out), *options)
    assert result.returncode == 0, result.stderr
    block = json.loads((out / "results.json").read_text())["privacy"]["adaptive_clip"]
    line = " ".join(result.stdout.split())
    assert f"adaptive clip toward the 0.5 quantile of update norms, C = 0.5 → {block['last']:.3g}" in line
