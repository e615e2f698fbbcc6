"""feast-edge simulate --personalize: every client runs the device's personalization step on its served variant, on
a held-out split of its shard that never trains, and the results, the console and the report say what it gained."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from feast_edge.data.holdout import holdout_split
from feast_edge.evaluate.evaluation import calibrated_variant
from feast_edge.personalize.select import Choice, personal_step, worst_decile
from feast_edge.report.runs import load_run
from feast_edge.report.summary import build_document, render_markdown
from feast_edge.run.checkpoint import load_supernet
from feast_edge.sim.setup import SimulationConfig, build_setup
from simconfigs import cli_options, tiny_config

CHOICE = "auto"


@pytest.fixture(scope="module")
def personalized(cli, tmp_path_factory, fashion_mnist_dir):
    """A tiny ``feast-edge simulate --personalize auto`` run (in this process); its directory, results and stdout.
    Of its 4 clients some hold too few examples to personalize, some do not."""
    out = tmp_path_factory.mktemp("personalized") / "run"
    config = tiny_config(fashion_mnist_dir, train_limit=400, seed=1)
    result = cli.invoke("simulate", "--out", str(out), *cli_options(config), "--personalize", CHOICE)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), result.stdout


def _config(results: dict, **changes) -> SimulationConfig:
    """The run's SimulationConfig, as results.json records it."""
    return SimulationConfig.recorded(results["config"], **changes)


def _shard(setup, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``i``'s whole shard, read from the population's partition (not through Setup.client_data)."""
    index = torch.as_tensor(setup.pool[setup.population.partition.shards[i]], dtype=torch.long)
    return setup.train_set.images[index], setup.train_set.labels[index]


@pytest.mark.slow
def test_each_client_holds_out_a_tenth_of_its_shard_and_never_trains_on_it(personalized) -> None:
    _, results, _ = personalized
    config = _config(results)
    assert (config.serving.personalize, config.serving.holdout) == (
        CHOICE,
        0.1,
    )  # the CLI's default share with --personalize
    setup = build_setup(config)
    for i, cid in enumerate(setup.client_ids):
        images, labels = _shard(setup, i)
        train, held = holdout_split(labels, 0.1, 0)  # the device agent's split of the same examples
        assert len(held) > 0 and len(train) + len(held) == len(labels)
        assert torch.equal(setup.client_data(cid)[0], images[train])
        assert torch.equal(setup.client_holdout(cid)[1], labels[held])
    # The training data is the shard less the held-out split: the run without --personalize trains on more.
    assert config.fingerprint() != _config(results, personalize="off", holdout=0.0).fingerprint()


@pytest.mark.slow
def test_the_block_holds_the_counts_of_personal_step_on_each_clients_served_variant(personalized) -> None:
    out, results, _ = personalized
    block = results["personalization"]
    config = _config(results)
    setup = build_setup(config)
    model = load_supernet(out / "best.safetensors", setup.preset)[0]  # the checkpoint the results test and serve
    rows = {r["client"]: r for r in block["clients"]}
    assert sorted(rows) == setup.client_ids
    for i, (cid, budget) in enumerate(zip(setup.client_ids, setup.population.budgets)):
        entry = setup.cache.largest_affordable(float(budget))
        served = calibrated_variant(model, entry.arch, setup.calibration_images())
        images, labels = _shard(setup, i)
        train, held = holdout_split(labels, 0.1, 0)
        outcome, own = personal_step(
            served, images[train], labels[train], images[held], labels[held], setup.preset, Choice.parse(CHOICE),
            seed=config.seed,
        )  # fmt: skip
        row = rows[cid]
        assert row["served_macs"] == entry.macs == results["variants"][results["served"][i]]["macs"]
        assert (row["method"], row["strength"], row["reason"]) == (outcome.method, outcome.strength, outcome.reason)
        assert (row["examples"], row["served_correct"], row["personal_correct"]) == (
            own.examples,
            own.served,
            own.personal,
        )
        # The classes its personal model was tuned to: those of its training split, by name (none without a model).
        held_classes = [setup.preset.task.classes[k] for k in sorted(set(labels[train].tolist()))]
        assert row.get("personal_classes") == (held_classes if outcome.model is not None else None)
    assert any(r["method"] for r in rows.values()) and any(not r["method"] for r in rows.values())


@pytest.mark.slow
def test_clients_without_a_personal_model_count_the_served_one_and_the_summary_is_their_mean(personalized) -> None:
    _, results, _ = personalized
    block = results["personalization"]
    rows, summary = block["clients"], block["summary"]
    for r in rows:
        assert 0 <= r["personal_correct"] <= r["examples"] and 0 <= r["served_correct"] <= r["examples"]
        assert r["served_accuracy"] == r["served_correct"] / r["examples"]
        if not r["method"]:
            assert r["personal_correct"] == r["served_correct"] and r["strength"] is None and r["reason"]
    served, personal = [r["served_accuracy"] for r in rows], [r["personal_accuracy"] for r in rows]
    assert summary["choice"] == CHOICE and summary["clients"] == summary["measured"] == len(rows)
    assert summary["personalized"] == sum(1 for r in rows if r["method"])
    assert summary["served_mean"] == pytest.approx(statistics.fmean(served))
    assert summary["personal_mean"] == pytest.approx(statistics.fmean(personal))
    assert summary["served_worst_decile"] == pytest.approx(min(served))  # 4 clients: the lowest tenth is one client
    assert summary["personal_worst_decile"] == pytest.approx(worst_decile(personal))
    assert summary["device_seconds_total"] == pytest.approx(sum(r["seconds"] for r in rows), abs=0.01)


@pytest.mark.slow
def test_the_console_and_the_report_show_the_mean_and_worst_decile(personalized, tmp_path: Path) -> None:
    out, results, stdout = personalized
    s = results["personalization"]["summary"]
    text = " ".join(stdout.replace("│", " ").replace("┃", " ").split())  # the table's cells, without its rules
    assert f"own held-out acc. ({CHOICE})" in text
    assert f"served {100 * s['served_mean']:.2f}% {100 * s['served_worst_decile']:.2f}%" in text
    assert f"personal {100 * s['personal_mean']:.2f}% {100 * s['personal_worst_decile']:.2f}%" in text
    assert f"personalization: {s['personalized']} of {s['clients']} clients chose a personal model" in text
    # A line per client whose personal model was tuned to fewer than all classes, naming them (results.json's words).
    fewer = [r for r in results["personalization"]["clients"] if r["method"] and r["tuned"]]
    assert s["tuned_to_fewer_classes"] == len(fewer)
    for r in fewer:
        assert r["tuned"].startswith(f"tuned to {len(r['personal_classes'])} of 10 classes: ")
        assert f"{r['client']}: personal model {r['tuned']}" in text
    report = render_markdown(build_document([load_run(out)], "t", [], []))
    row = (
        f"| {out} | {CHOICE} | {s['personalized']}/{s['clients']} | {100 * s['served_mean']:.2f} | "
        f"{100 * s['personal_mean']:.2f} | {100 * s['served_worst_decile']:.2f} | "
        f"{100 * s['personal_worst_decile']:.2f} |"
    )
    assert "## Personalization" in report and row in report
    if fewer:
        assert f"{out}: {len(fewer)} of {s['personalized']} personal models were tuned to fewer than all" in report


def test_without_personalize_nothing_is_held_out_and_the_fingerprint_is_unchanged() -> None:
    plain = tiny_config()
    assert (plain.serving.personalize, plain.serving.holdout) == ("off", 0.0)
    assert "holdout" not in plain.decisive() and "personalize" not in plain.decisive()
    asked = tiny_config(personalize="prior", holdout=0.1)
    assert asked.decisive() == {**plain.decisive(), "holdout": 0.1}  # the choice itself changes no weight


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--personalize", "bogus"],
            "--personalize 'bogus' is unknown; choose one of auto, off, prior, head, bn, proximal",
        ),
        (["--personalize", "prior:9"], "--personalize prior:9: its tau must be a number in [0, 4]"),
        (["--personalize", "head", "--holdout", "0"], "needs each client's own held-out split: give --holdout > 0"),
        (["--personalize", "auto", "--holdout", "0.95"], "--holdout 0.95 must be a fraction between 0 and 0.9"),
        (
            ["--holdout", "0.2"],
            "--holdout 0.2 holds out examples that only --personalize and --validate-on devices measure on",
        ),
        (["--personalize", "auto", "--method", "heterofl"], "--personalize auto applies to --method feast only"),
    ],
)
def test_a_bad_personalize_setting_is_one_line_before_any_data_is_read(cli, tmp_path, args, fragment) -> None:
    cli.assert_user_error(cli.invoke("simulate", "-o", str(tmp_path), "--data", str(tmp_path), *args), fragment)
