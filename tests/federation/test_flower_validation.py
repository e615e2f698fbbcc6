"""A Flower run without server data validates each validated round on the nodes' own held-out splits, and the served
round is the rule's choice (feast_edge.evaluate.served_round), as ``feast-server run`` without ``--data`` does.

The ServerApp's FlowerFederation (its real run loop, registry, checks and checkpoints) talks to feast-edge's real
ClientApp handlers through flowerkit's LoopbackGrid (the Messages of a real run, delivered in this process), on real
Fashion-MNIST shards of the tiny preset, as tests/federation/test_flower_nodes.py does.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
from flwr.app import Context, Message

from feast_edge.agent.local_data import load_clients
from feast_edge.evaluate.candidates import on_devices
from feast_edge.evaluate.device_validation import device_record, validation_targets
from feast_edge.evaluate.federated import held_out_counts
from feast_edge.evaluate.served_round import figures_of, served_round
from feast_edge.flower import clientapp, records, validation_records
from feast_edge.protocol import MAX_PROBES, Evaluated
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.loop import BEST, CHECKPOINT, PREVIOUS
from flowerkit import LoopbackGrid, loopback_federation, set_flower_identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HOLDOUT = 0.2  # run config node-holdout: the share of each simulated node's shard it holds out


@pytest.fixture(autouse=True)
def flower_identity() -> None:
    set_flower_identity()


def _nodes(grid: LoopbackGrid, count: int = 3, **handlers) -> None:
    """Simulated nodes (partition-id only), the first with ``handlers``."""
    for i in range(count):
        grid.add(100 + i, {"partition-id": i, "num-partitions": count}, **(handlers if i == 0 else {}))


@pytest.fixture(scope="module")
def validated(kit, partition: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three rounds of three honest simulated nodes holding out 0.2 of their shards, a server without data, each
    round validated (the last one's own weights and the mean of rounds 1-3's, --serve-average 3); then the export."""
    set_flower_identity()
    grid = LoopbackGrid(run_config={"node-data": str(partition), "node-holdout": HOLDOUT})
    _nodes(grid)
    out = tmp_path_factory.mktemp("flower-validation") / "run"
    federation = loopback_federation(kit, out, "", grid, rounds=3, serve_average=3)
    history = federation.run()
    return {"federation": federation, "history": history, "manifests": federation.export_models()}


def test_every_validated_round_is_validated_by_every_cohort_node_on_its_held_out_split(validated: dict) -> None:
    federation, history = validated["federation"], validated["history"]
    assert federation.data is None and [h.round for h in history] == [1, 2, 3]
    for h in history:
        v = h.validation
        assert v["source"] == "devices" and sorted(v["devices"]) == sorted(h.cohort) and len(h.cohort) == 3
        assert sorted(v["served"]) == sorted(h.cohort)  # every node's figure on its served variant: its vote
        assert v["missing"] == [] and v["seconds"] >= 0 and v["served_round"] is not None and v["served_reason"]
        assert h.val_accuracy is not None and 0 <= h.val_accuracy <= 1
        for device in h.cohort:
            holdout = federation.registry.get(device).profile["holdout"]
            assert holdout > 0 and v["served"][device][2] == holdout  # the whole held-out split, no more


def test_the_counts_are_held_out_counts_on_each_nodes_own_split(validated: dict, partition: Path) -> None:
    """Round 2's record equals device_record over held_out_counts called directly on each node's data with round 2's
    checkpoint (the previous one): the routed slice, the targets and the class-balanced calibration are the agent's."""
    federation, last = validated["federation"], validated["history"][-2]
    assert last.average_of is None and last.candidates == {} and validated["history"][-1].candidates["of"] == [1, 3]
    model = load_supernet(federation.out / PREVIOUS, federation.preset)[0]
    cache, validation = federation.cache, federation.validation
    devices = {d.device_id: d for d in federation.registry.devices()}
    targets = validation_targets(cache, validation.probes, [d.budget_macs for d in devices.values()], MAX_PROBES)
    reports, served, mixes = {}, {}, {}
    for offset in range(3):
        client = load_clients(partition, "direct", 1, None, offset, task=federation.preset.task, holdout=HOLDOUT)[0]
        budget = devices[client.device_id].budget_macs
        affordable = [e for e in targets if e.macs <= budget]
        counts = held_out_counts(
            model,
            [e.arch for e in affordable],
            client.images,
            client.holdout_images,
            client.holdout_labels,
            federation.config.validation.calib_samples,
            train_labels=client.labels,
        )
        by_target = dict(zip(affordable, counts))
        reports[client.device_id] = [by_target.get(e, (0, 0)) for e in targets]
        served[client.device_id] = cache.largest_affordable(budget)
        mixes[client.device_id] = devices[client.device_id].profile["holdout_counts"]
        assert sum(mixes[client.device_id]) == client.holdout  # the class mix the node registered
    _, want = device_record(
        reports,
        targets,
        validation.probes,
        cache,
        served,
        mixes,
        federation.config.validation.val_rule,
        validation.max_weight_ratio,
    )
    got = {k: v for k, v in last.validation.items() if k in want}
    assert got == want


def test_the_served_round_is_the_rules_choice_and_every_manifest_names_it(validated: dict) -> None:
    federation, history = validated["federation"], validated["history"]
    choice = served_round([(h.round, h.validation) for h in history])
    assert choice.round is not None
    # Round 3 offered the better of its own weights and the mean of rounds 1-3's, on the same examples of each node.
    candidates = history[-1].candidates
    assert sorted(candidates["voters"]) == sorted(history[-1].cohort)  # every node tested both
    own, mean = (candidates[c]["validation"]["served"] for c in ("own", "mean"))
    assert all(own[d][0] == mean[d][0] and own[d][2] == mean[d][2] for d in own)  # same variant, same examples
    offered = on_devices(3, [1, 3], figures_of({"served": own}), figures_of({"served": mean})).candidate
    assert candidates["choice"] == offered and history[-1].validation["served"] == {
        **(mean if offered == "mean" else own)
    }
    reason = f"{candidates['reason']}; {choice.reason}" if choice.round == 3 else choice.reason
    assert history[-1].validation["served_round"] == choice.round
    assert history[-1].validation["served_reason"] == reason
    assert federation.loop.best["round"] == choice.round and (federation.out / BEST).is_file()
    manifests = validated["manifests"]
    assert sorted(m["device"] for m in manifests) == sorted(history[-1].cohort)
    for manifest in manifests:
        assert manifest["served_round"]["round"] == choice.round and manifest["served_round"]["of"] == 3
        assert manifest["served_round"]["reason"] == reason and manifest["checkpoint"] == BEST
        averaged = choice.round == 3 and offered == "mean"
        assert manifest["served_round"].get("average_of") == ([1, 3] if averaged else None)


def _inflated(message: Message, context: Context) -> Message:
    """A node that claims more held-out examples than it registered (its answer weighs the round's figure)."""
    reply = clientapp.evaluate(message, context)
    if not validation_records.is_validation(message.content):
        return reply
    answer = records.read_message(reply.content, Evaluated)
    results = tuple(v + 1000 if k % 2 else v for k, v in enumerate(answer.results))
    return Message(validation_records.counts_content(replace(answer, results=results)), reply_to=message)


def _forgetful(message: Message, context: Context) -> Message:
    """A node that registered a held-out split but answers a validation from a configuration without one."""
    run_config = {k: v for k, v in context.run_config.items() if k != "node-holdout"}
    other = Context(
        run_id=1, node_id=context.node_id, node_config=context.node_config, state=context.state, run_config=run_config
    )
    return clientapp.evaluate(message, other)


def test_impossible_counts_are_refused_a_declining_node_is_named_and_the_others_validate(
    kit, partition: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grid = LoopbackGrid(run_config={"node-data": str(partition), "node-holdout": HOLDOUT})
    grid.add(100, {"partition-id": 0, "num-partitions": 3}, evaluate=_inflated)
    grid.add(101, {"partition-id": 1, "num-partitions": 3})
    grid.add(102, {"partition-id": 2, "num-partitions": 3}, evaluate=_forgetful)
    federation = loopback_federation(kit, tmp_path / "run", "", grid)
    with caplog.at_level(logging.INFO):
        record = federation.run()[0]
    liar, honest, forgetful = (federation.nodes.device_of[n] for n in (100, 101, 102))
    assert record.applied and sorted(record.updated) == sorted([liar, honest, forgetful])  # training is untouched
    v = record.validation
    assert v["source"] == "devices" and v["devices"] == [honest] and v["missing"] == sorted([liar, forgetful])
    assert list(v["served"]) == [honest] and v["served_round"] == 1 and record.val_accuracy is not None
    text = caplog.text
    assert f"{liar} did not validate the model: its counts were refused: it counts more examples than the" in text
    assert f"{forgetful} did not validate the model: it declined: this node holds no examples out" in text
    assert "round 1: federated validation (median of 1 node(s)" in text


def test_when_every_answer_is_refused_the_round_names_them_and_the_last_round_is_served(
    kit, partition: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grid = LoopbackGrid(run_config={"node-data": str(partition), "node-holdout": HOLDOUT})
    for i in range(3):
        grid.add(100 + i, {"partition-id": i, "num-partitions": 3}, evaluate=_inflated)
    federation = loopback_federation(kit, tmp_path / "run", "", grid)
    with caplog.at_level(logging.INFO):
        record = federation.run()[0]
    v = record.validation
    assert v["source"] == "devices" and v["devices"] == [] and v["missing"] == sorted(record.cohort)
    assert v["served"] == {} and v["served_round"] is None and record.val_accuracy is None
    assert federation.loop.selected_checkpoint().name == CHECKPOINT
    assert "the last round, 1, is served" in caplog.text


def test_without_held_out_splits_no_round_is_validated_and_the_last_round_is_served(
    kit, partition: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    grid = LoopbackGrid(run_config={"node-data": str(partition)})  # shards hold nothing out by default
    _nodes(grid)
    federation = loopback_federation(kit, tmp_path / "run", "", grid)
    with caplog.at_level(logging.INFO):
        record = federation.run()[0]
    assert record.applied and record.validation == {} and record.val_accuracy is None
    assert federation.loop.selected_checkpoint().name == CHECKPOINT
    assert "no cohort node holds out examples to validate the model on" in caplog.text
    assert "no round was validated (no cohort node with a held-out split answered" in caplog.text
    assert "the last round, 1, is served" in caplog.text
    manifest = federation.export_models()[0]
    assert manifest["served_round"]["round"] == 1 and "the last round" in manifest["served_round"]["reason"]
