"""Run config ``personalize`` on Flower: after the last round each node runs the device's personalization step on its
served variant and its own held-out split, and the ServerApp keeps the counts it can believe.

The ServerApp's FlowerFederation talks to feast-edge's real ClientApp handlers through flowerkit's LoopbackGrid (the
Messages of a real run, delivered in this process), as tests/federation/test_flower_nodes.py does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict

from feast_edge.agent.local_data import load_clients
from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.evaluation import calibrated_variant
from feast_edge.evaluate.federated import calibrated_static
from feast_edge.flower import clientapp, records, serverapp
from feast_edge.flower.serverapp import FlowerFederation
from feast_edge.flower.serverapp.personalize_nodes import PERSONALIZATION, personalize_nodes
from feast_edge.flower.serverapp.run_config import server_config
from feast_edge.personalize.select import Choice, personal_step
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.loop import BEST
from feast_edge.server.config import ServerError
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from flowerkit import LoopbackGrid, loopback_federation, set_flower_identity
from strategies import FMNIST_TINY

CHOICE = Choice.parse("auto")


@pytest.fixture(autouse=True)
def flower_identity() -> None:
    set_flower_identity()


def _inflated(message: Message, context: Context) -> Message:
    """A node that claims its personal model got one more example right than it holds out."""
    reply = clientapp.evaluate(message, context)
    counts = reply.content.metric_records[records.PERSONAL]
    counts["personal-correct"] = counts["examples"] + 1
    return reply


@pytest.fixture(scope="module")
def personalized(kit, partition: Path, tmp_path_factory):
    """Three nodes, one round, then ``personalize = "auto"`` with the server's data: node 101 honest (a simulated node,
    node-holdout 0.1 of the largest shard), node 100 inflating its count, node 102 with its own data and no held-out
    split."""
    set_flower_identity()
    grid = LoopbackGrid(run_config={"node-data": str(partition), "node-holdout": 0.1})
    grid.add(100, {"partition-id": 0, "num-partitions": 3}, evaluate=_inflated)
    grid.add(101, {"partition-id": 1, "num-partitions": 3})
    grid.add(102, {"data": str(partition), "offset": 2})
    federation = loopback_federation(kit, tmp_path_factory.mktemp("flower-personal") / "run", partition, grid)
    federation.run()
    return federation, personalize_nodes(federation, federation.nodes, CHOICE)


def _direct(federation: FlowerFederation, partition: Path, offset: int, served) -> tuple:
    """What ``personal_step`` says for client ``offset`` of the partition, with the node's held-out split (0.1)."""
    client = load_clients(partition, "direct", 1, None, offset, task=federation.preset.task, holdout=0.1)[0]
    return client, personal_step(
        served,
        client.images,
        client.labels,
        client.holdout_images,
        client.holdout_labels,
        federation.preset,
        CHOICE,
        seed=federation.config.seed,
    )


@pytest.mark.slow
def test_a_node_returns_the_counts_of_personal_step_on_its_server_calibrated_served_variant(
    personalized, partition: Path
) -> None:
    federation, record = personalized
    model = load_supernet(federation.loop.selected_checkpoint(), federation.preset)[0]
    device = federation.nodes.device_of[101]
    budget = federation.registry.get(device).budget_macs
    entry = federation.cache.largest_affordable(budget)
    served = calibrated_variant(model, entry.arch, federation.data.calibration_images)
    client, (outcome, own) = _direct(federation, partition, 1, served)
    row = next(r for r in record["clients"] if r["client"] == device)
    assert client.device_id == device and record["calibration"] == "server"
    assert own.examples > 0 and outcome.candidates  # the node had enough examples to choose among the methods
    assert (row["method"], row["strength"], row["reason"]) == (outcome.method, outcome.strength, outcome.reason)
    assert (row["examples"], row["served_correct"], row["personal_correct"]) == (own.examples, own.served, own.personal)
    assert row["served_macs"] == entry.macs
    # The classes its personal model was tuned to travel with the counts, checked against the ServerApp's task.
    tuned = None if outcome.model is None else outcome.tuned
    assert row.get("personal_classes") == (None if tuned is None else list(tuned.classes))
    assert row.get("tuned") == (None if tuned is None else tuned.words())
    assert json.loads((federation.out / PERSONALIZATION).read_text()) == record


@pytest.mark.slow
def test_impossible_counts_are_refused_and_a_node_without_a_held_out_split_is_not_measured(personalized) -> None:
    federation, record = personalized
    liar, own_data = federation.nodes.device_of[100], federation.nodes.device_of[102]
    assert "its counts were refused: it counts more right answers than its" in record["refused"][liar]
    rows = {r["client"]: r for r in record["clients"]}
    assert liar not in rows
    assert rows[own_data]["examples"] == 0 and rows[own_data]["method"] == ""
    assert "no held-out split" in rows[own_data]["reason"]
    honest = rows[federation.nodes.device_of[101]]
    summary = record["summary"]
    assert (summary["clients"], summary["measured"]) == (2, 1)
    assert summary["served_mean"] == summary["served_worst_decile"] == honest["served_accuracy"]
    assert summary["personal_mean"] == summary["personal_worst_decile"] == honest["personal_accuracy"]


@pytest.mark.slow
def test_the_serverapp_personalizes_after_the_rounds_and_without_data_each_node_calibrates_bn_itself(
    kit, partition: Path, tmp_path: Path
) -> None:
    """The ServerApp's main with run config personalize and no server data: each node recalibrates its served
    variant's BN on its own training split (as the agent does) before the step."""
    out = tmp_path / "run"
    run_config = {
        "out-dir": str(out),
        "rounds": 1,
        "per-round": 2,
        "min-clients": 2,
        "start-clients": 2,
        "seed": kit.CONFIG.seed,
        "batch-size": kit.CONFIG.training.batch_size,
        "wait-timeout": 5.0,
        "export": False,
        "personalize": str(CHOICE),
        "node-data": str(partition),
        "node-holdout": 0.1,
    }
    grid = LoopbackGrid(run_config=run_config)
    for i in range(2):
        grid.add(100 + i, {"partition-id": i, "num-partitions": 3})
    serverapp.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=grid.run_config))
    record = json.loads((out / PERSONALIZATION).read_text())
    config, _ = server_config(grid.run_config)
    preset = load_preset(str(FMNIST_TINY))
    client = load_clients(partition, "direct", 1, None, 1, task=preset.task, holdout=0.1)[0]
    # Without data the nodes validate on their held-out splits: the one validated round is served (best.safetensors).
    model = load_supernet(out / BEST, preset)[0]
    served = extract(model, load_cache(preset).largest_affordable(client.budget_macs).arch)
    calibrated_static(served, preset, client.images, config.validation.calib_samples, labels=client.labels)
    outcome, own = personal_step(
        served,
        client.images,
        client.labels,
        client.holdout_images,
        client.holdout_labels,
        preset,
        CHOICE,
        seed=config.seed,
    )
    row = next(r for r in record["clients"] if r["client"] == client.device_id)
    assert record["calibration"] == "device" and record["checkpoint"] == BEST and not record["refused"]
    assert outcome.candidates  # the node had enough examples to choose among the methods
    assert (row["method"], row["examples"], row["served_correct"], row["personal_correct"]) == (
        outcome.method,
        own.examples,
        own.served,
        own.personal,
    )


def test_the_run_config_takes_personalize_and_node_holdout_and_names_the_choices(tmp_path: Path) -> None:
    base = {"out-dir": str(tmp_path)}
    server_config({**base, "personalize": "prior:0.5", "node-holdout": 0.1})
    with pytest.raises(ServerError, match=r"personalize: 'bogus' is unknown; choose one of auto, off, prior, head"):
        server_config({**base, "personalize": "bogus"})
    with pytest.raises(ServerError, match=r"node-holdout = 2.0 must be a fraction between 0 and 0.9"):
        server_config({**base, "node-holdout": 2.0})


@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_flower_run_config_with_dp_is_refused_naming_where_dp_runs(tmp_path: Path, mode: str) -> None:
    private = {"out-dir": str(tmp_path), "dp-clip": 1.0, "dp-noise": 1.0, "dp-mode": mode}
    with pytest.raises(
        ServerError, match=r"run config dp-clip, dp-mode, dp-noise: differential privacy runs with feast-server run"
    ):
        server_config(private)
