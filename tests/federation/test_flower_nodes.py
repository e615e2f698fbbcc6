"""The Flower ServerApp's side of hostile and misconfigured nodes: each is refused with its reason, the run goes on.

The ServerApp's FlowerFederation (its real run loop, registry, checks and checkpoints) talks to feast-edge's real
ClientApp handlers through a Grid that delivers Flower Messages in this process (``LoopbackGrid``), so a test can
play a node that lies. tests/federation/test_flower.py runs the same code over a real SuperLink and SuperNodes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flwr.app import Array, Context, Message, RecordDict

from feast_edge.flower import clientapp, records
from feast_edge.protocol import RoundStart
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT
from feast_edge.sim.shards import read_index
from flowerkit import Handler, LoopbackGrid, loopback_federation, set_flower_identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def flower_identity() -> None:
    set_flower_identity()


def _good_nodes(grid: LoopbackGrid, partition: Path, count: int = 3, **handlers: Handler) -> None:
    for i in range(count):
        grid.add(100 + i, {"data": str(partition), "offset": i, "threads": 1}, **(handlers if i == 0 else {}))


def test_a_node_of_another_feast_edge_version_declines_and_the_run_goes_on(
    kit, partition: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grid = LoopbackGrid()
    _good_nodes(grid, partition, 2)

    def older(message: Message, context: Context) -> Message:
        monkeypatch.setattr(clientapp, "__version__", "0.0.9")
        try:
            return clientapp.register(message, context)
        finally:
            monkeypatch.undo()

    grid.add(7, {"data": str(partition), "offset": 2}, query=older)
    federation = loopback_federation(kit, tmp_path / "run", partition, grid, per_round=2)
    history = federation.run()
    reason = federation.nodes.answered[7]
    assert "runs feast-edge 0.0.9, the ServerApp" in reason and "install the same feast-edge version" in reason
    assert history[0].applied and sorted(history[0].updated) == ["client-000", "client-001"]


def test_nodes_without_data_or_budget_decline_with_the_fix(kit, partition: Path, tmp_path: Path) -> None:
    grid = LoopbackGrid()
    _good_nodes(grid, partition, 2)
    grid.add(8, {"threads": 1})
    grid.add(9, {"data": "/usr/share/datasets/fashion-mnist", "shard": "0/100"})  # no budget for its own data
    federation = loopback_federation(kit, tmp_path / "run", partition, grid, per_round=2)
    federation.run()
    assert "this SuperNode has no data" in federation.nodes.answered[8]
    assert "no MAC budget for device node-9" in federation.nodes.answered[9]
    assert sorted(d.device_id for d in federation.registry.devices()) == ["client-000", "client-001"]


def test_a_node_claiming_another_nodes_identity_is_refused(kit, partition: Path, tmp_path: Path) -> None:
    grid = LoopbackGrid()
    _good_nodes(grid, partition, 2)

    def impostor(message: Message, context: Context) -> Message:
        forged = Context(
            run_id=1, node_id=100, node_config=context.node_config, state=RecordDict(), run_config=context.run_config
        )
        return clientapp.register(message, forged)  # says it is node 100's host

    grid.add(11, {"data": str(partition), "offset": 2}, query=impostor)
    federation = loopback_federation(kit, tmp_path / "run", partition, grid, per_round=2)
    federation.run()
    assert "registers as host 'node-100', but it is node-11" in federation.nodes.answered[11]


def _tampered(change: Callable[[RecordDict], None]) -> Handler:
    def train(message: Message, context: Context) -> Message:
        reply = clientapp.train(message, context)
        change(reply.content)
        return reply

    return train


def _nan(content: RecordDict) -> None:
    arrays = content.array_records[records.UPDATE]
    name = next(k for k in arrays.keys() if not k.endswith("num_batches_tracked"))
    value = arrays[name].numpy().copy()
    value.reshape(-1)[0] = float("nan")
    arrays[name] = Array(value)


def _extra(content: RecordDict) -> None:
    content.array_records[records.UPDATE]["attacker.weight"] = Array(torch.zeros(4).numpy())


@pytest.mark.parametrize(
    ("change", "reason"),
    [(_nan, "do not match their transfer"), (_extra, "do not match the envelope")],
    ids=["nan", "extra-array"],
)
def test_a_tampered_update_is_rejected_and_the_others_are_aggregated(
    kit, partition: Path, tmp_path: Path, change: Callable, reason: str
) -> None:
    grid = LoopbackGrid()
    _good_nodes(grid, partition, 3, train=_tampered(change))
    federation = loopback_federation(kit, tmp_path / "run", partition, grid)
    record = federation.run()[0]
    assert reason in record.rejected["client-000"]
    assert record.applied and sorted(record.updated) == ["client-001", "client-002"]
    assert read_record(tmp_path / "run" / CHECKPOINT)["fields"]["round"] == 1


def test_a_clientapp_that_raises_is_incomplete_and_the_run_goes_on(kit, partition: Path, tmp_path: Path) -> None:
    grid = LoopbackGrid()

    def crash(message: Message, context: Context) -> Message:
        from flwr.app import Error

        return Message(Error(code=2, reason="<class 'RuntimeError'>:<'out of memory'>"), reply_to=message)

    _good_nodes(grid, partition, 3, train=crash)
    record = loopback_federation(kit, tmp_path / "run", partition, grid).run()[0]
    assert (
        "the ClientApp failed" in record.incomplete["client-000"] and "out of memory" in record.incomplete["client-000"]
    )
    assert record.applied and sorted(record.updated) == ["client-001", "client-002"]


def test_a_round_for_another_device_is_declined_by_the_node(kit, partition: Path, tmp_path: Path) -> None:
    grid = LoopbackGrid()
    entries = read_index(partition)["clients"]

    def swapped(message: Message, context: Context) -> Message:
        other = Context(
            run_id=1,
            node_id=context.node_id,
            node_config={"data": str(partition), "offset": 2},
            state=RecordDict(),
            run_config=context.run_config,
        )
        return clientapp.train(message, other)

    _good_nodes(grid, partition, 3, train=swapped)
    record = loopback_federation(kit, tmp_path / "run", partition, grid).run()[0]
    assert f"this SuperNode is {entries[2]['client_id']!r}" in record.declined["client-000"]
    assert record.applied and "client-000" not in record.updated


def test_simulated_nodes_take_their_shard_of_the_run_configs_partition(kit, partition: Path, tmp_path: Path) -> None:
    """Flower's Simulation Engine gives a node only its partition-id; the run config's node-data names the partition."""
    grid = LoopbackGrid(run_config={"node-data": str(partition)})
    for i in range(3):
        grid.add(200 + i, {"partition-id": i, "num-partitions": 3})
    federation = loopback_federation(kit, tmp_path / "run", partition, grid)
    record = federation.run()[0]
    assert record.applied and sorted(record.updated) == ["client-000", "client-001", "client-002"]


def test_a_crashed_run_resumes_from_its_last_round_with_the_same_weights(kit, partition: Path, tmp_path: Path) -> None:
    def power_cut(message: Message, context: Context) -> Message:
        if records.read_message(message.content, RoundStart).round == 1:
            raise KeyboardInterrupt("power cut during round 2")
        return clientapp.train(message, context)

    crashing = LoopbackGrid()
    _good_nodes(crashing, partition, 3, train=power_cut)
    with pytest.raises(KeyboardInterrupt):
        loopback_federation(kit, tmp_path / "resumed", partition, crashing, rounds=2).run()
    assert read_record(tmp_path / "resumed" / CHECKPOINT)["fields"]["round"] == 1
    again = LoopbackGrid()
    _good_nodes(again, partition, 3)
    resumed = loopback_federation(kit, tmp_path / "resumed", partition, again, rounds=2)
    assert [h.round for h in resumed.run()] == [1, 2]
    whole = LoopbackGrid()
    _good_nodes(whole, partition, 3)
    loopback_federation(kit, tmp_path / "whole", partition, whole, rounds=2).run()
    got, want = kit.weights(tmp_path / "resumed" / CHECKPOINT), kit.weights(tmp_path / "whole" / CHECKPOINT)
    assert all(torch.equal(got[k], want[k]) for k in want)
