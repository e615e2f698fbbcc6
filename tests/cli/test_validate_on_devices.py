"""``feast-edge simulate --validate-on devices``: the cohort validates on its own held-out splits in process, and the
served round is chosen as a server without data chooses it (feast_edge.evaluate.served_round)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.served_round import served_round
from feast_edge.space.preset import load_preset
from simconfigs import cli_options, tiny_config


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_each_client_votes_with_its_served_variant_and_the_run_names_the_served_round(
    cli, tmp_path: Path, fashion_mnist_dir: Path
) -> None:
    config = tiny_config(fashion_mnist_dir, clients=3, per_round=3, rounds=3, eval_every=1, train_limit=600)
    out = tmp_path / "sim"
    command = [*cli_options(config), "--validate-on", "devices", "--serve-average", "2"]
    result = cli.run("simulate", "--out", str(out), *command, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    cache = load_cache(load_preset(config.preset))
    budgets = results["population"]["budgets"]
    history = [(r["round"], r["validation"]) for r in results["rounds"]]
    for round_, validation in history:
        assert validation["source"] == "devices" and validation["devices"] == ["client-000", "client-001", "client-002"]
        # Each client's vote is its own served variant (its largest affordable), on its own held-out examples.
        for k, client in enumerate(validation["devices"]):
            label, correct, total = validation["served"][client]
            assert label == f"variant {cache.entries.index(cache.largest_affordable(budgets[k]))}"
            assert 0 <= correct <= total and total > 0
    # Round 3 offered its own weights or the mean of rounds 2-3's, whichever its clients' paired figures favoured.
    candidates = results["rounds"][-1]["candidates"]
    assert candidates["of"] == [2, 3] and sorted(candidates["voters"]) == ["client-000", "client-001", "client-002"]
    assert history[-1][1] == candidates[candidates["choice"]]["validation"] | {
        k: v for k, v in history[-1][1].items() if k.startswith("served_")
    }
    # The run's choice is the rule's over its own records, and is said with both steps' reasons.
    choice = served_round(history)
    assert results["best"]["round"] == results["served_round"]["round"] == choice.round
    served, last = results["served_round"], len(history)
    if choice.round == last:
        assert served["reason"] == f"{candidates['reason']}; {choice.reason}" == history[-1][1]["served_reason"]
        mean = candidates["choice"] == "mean"
        assert served.get("average_of") == results["rounds"][-1]["average_of"] == ([2, 3] if mean else None)
    else:
        assert "average_of" not in served and served["reason"].startswith(choice.reason)
    words = " ".join(result.stdout.split())
    assert f"(served round, round {choice.round})" in words and " ".join(choice.reason.split()) in words
    assert f"served round {choice.round}" in result.stdout


def test_device_validation_needs_the_clients_held_out_splits(cli, tmp_path: Path, fashion_mnist_dir: Path) -> None:
    base = ["simulate", "--out", str(tmp_path), *cli_options(tiny_config(fashion_mnist_dir))]
    error = "--validate-on devices validates FEAST's variants on each client's held-out split"
    cli.assert_user_error(cli.invoke(*base, "--validate-on", "devices", "--holdout", "0"), error)
    cli.assert_user_error(cli.invoke(*base, "--validate-on", "clients"), "--validate-on 'clients' is unknown")
