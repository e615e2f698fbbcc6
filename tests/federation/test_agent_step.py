"""The agent's pieces around its training step: the step itself, the inbox's word on overtaken rounds, the transfer wait.

``train(job) -> Trained | Declined`` must compute exactly ``client_update``;
the wait for a round's payload handles no message itself and ends when the
inbox says a newer round (or the federation's end) arrived.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from feast_edge.agent.agent import Agent, AgentConfig
from feast_edge.agent.downloads import Downloads
from feast_edge.agent.inbox import Inbox
from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.step import Assignment, Declined, Job, Trained, train
from feast_edge.cache.variants import load_cache
from feast_edge.errors import FeastError
from feast_edge.local.recipe import TrainConfig
from feast_edge.local.update import client_update
from feast_edge.protocol import Finished, Metrics, RoundStart
from feast_edge.route.envelope import route_state
from feast_edge.route.payload import encode
from feast_edge.route.plans import plan_client
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.chunks import Progress, Status
from feast_edge.transport.frames import TransferInfo, describe
from feast_edge.transport.link import Link, Received
from feast_edge.transport.messages import parse
from feast_edge.transport.topics import Topics

PRESET = load_preset("fmnist-small")
BUDGET = 6e6


def _client(device_id: str = "d", n: int = 16) -> LocalClient:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 1, 28, 28), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, PRESET.classes, (n,), generator=generator)
    return LocalClient(device_id, images, labels, None, None, None, "memory")


def _round(
    device_id: str = "d",
    t: int = 0,
    lr: float = 0.05,
    timeout: float = 30.0,
    federation: str = "lab",
    instance: str = "agent1",
) -> tuple[RoundStart, bytes]:
    """A round message for ``device_id`` and the routed payload it announces."""
    plan = plan_client(load_cache(PRESET), BUDGET)
    routed = route_state(Supernet(PRESET).state_dict(), plan.layout(PRESET, PRESET.classes), PRESET)
    blob = encode(routed, plan.manifest(PRESET, PRESET.classes, t, "routed", device_id))
    info = describe(blob, federation=federation, round=t, device=device_id)
    start = RoundStart.from_plan(
        plan, federation=federation, round=t, device=device_id, instance=instance, transfer=info, sent_at=time.time(), timeout=timeout,
        rounds=2, lr=lr, seed=7, train=TrainConfig(batch_size=8),
    )  # fmt: skip
    return start, blob


def test_the_step_computes_exactly_what_client_update_computes(one_thread) -> None:
    start, blob = _round()
    client = _client()
    assignment = Assignment.parse(start, PRESET)
    outcome = train(Job.of(assignment, blob, client, PRESET, "cpu", "off"))
    assert isinstance(outcome, Trained)
    job = Job.of(assignment, blob, client, PRESET, "cpu", "off")
    state, result = client_update(
        PRESET, PRESET.classes, assignment.plan, job.routed, client.images, client.labels, assignment.settings,
        start.lr, start.client_seed, "cpu", "off",
    )  # fmt: skip
    expected = encode(state, assignment.plan.manifest(PRESET, PRESET.classes, 0, "update", "d"))
    assert outcome.payload == expected, "the agent's step must train bit for bit what the simulator trains"
    assert outcome.result.mean_loss == result.mean_loss and outcome.compute_seconds > 0


def test_a_diverging_step_is_declined_with_its_reason(one_thread) -> None:
    start, blob = _round(lr=1e30)
    outcome = train(Job.of(Assignment.parse(start, PRESET), blob, _client(), PRESET, "cpu", "off"))
    assert isinstance(outcome, Declined) and outcome.reason.startswith("training diverged")


def test_a_payload_that_is_not_what_the_round_routes_is_refused_before_training() -> None:
    start, _ = _round(t=0)
    _, other_round = _round(t=1)
    with pytest.raises(FeastError, match="round"):
        Job.of(Assignment.parse(start, PRESET), other_round, _client(), PRESET, "cpu", "off")


class _FakeLink:
    """Collects the handlers a subscription installs, so a test can play paho's thread."""

    def __init__(self) -> None:
        self.handlers: dict[str, Callable[[Received], None]] = {}

    def subscribe(self, topic: str, handler: Callable[[Received], None]) -> None:
        self.handlers[topic] = handler


def test_the_inbox_says_a_new_round_or_the_end_overtakes_a_round_and_a_repeat_or_another_device_does_not() -> None:
    topics, link = Topics("lab"), _FakeLink()
    announced: list[str] = []
    inbox = Inbox(topics, lambda device_id, message: announced.append(device_id))
    inbox.instance = "agent1"
    inbox.subscribe(link, ["d", "e"], "host", on_own_offline=lambda: None)  # type: ignore[arg-type]
    deliver = {d: link.handlers[topics.ctrl(d)] for d in ("d", "e")}
    replayed, _ = _round("d", t=0, instance="earlier1")  # a signed round of an earlier run: another agent instance
    deliver["d"](Received(topics.ctrl("d"), replayed.encode()))
    assert inbox.get(0) is None and announced == []  # dropped before its download is expected
    first, _ = _round("d", t=0)
    deliver["d"](Received(topics.ctrl("d"), first.encode()))
    running = inbox.get(0)
    assert running is not None and running.message == first and announced == ["d"]
    deliver["d"](Received(topics.ctrl("d"), first.encode()))  # a repeat (QoS 1 redelivery): same msg_id
    deliver["e"](Received(topics.ctrl("e"), _round("e", t=1)[0].encode()))
    assert not inbox.overtaken("d", running.number)
    deliver["d"](Received(topics.ctrl("d"), _round("d", t=1)[0].encode()))
    assert inbox.overtaken("d", running.number)
    latest = [inbox.get(0) for _ in range(3)][-1]
    assert latest is not None and not inbox.overtaken("d", latest.number)

    def finished(instance: str) -> Received:
        end = Finished(federation="lab", round=1, device="d", rounds=2, completed=2, instance=instance)
        return Received(topics.ctrl("d"), end.encode())

    deliver["d"](finished("earlier1"))  # replayed from an earlier run (another agent instance): overtakes nothing
    assert not inbox.overtaken("d", latest.number)
    deliver["d"](finished("agent1"))
    assert inbox.overtaken("d", latest.number)


class _FakeReceiver:
    """Finished transfers as a ChunkReceiver hands them out."""

    def __init__(self, *finished: Progress) -> None:
        self.results: queue.Queue[Progress] = queue.Queue()
        self.expected: list[str] = []
        for progress in finished:
            self.results.put(progress)
        self.reassembler = self

    def get(self, timeout: float) -> Progress | None:
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None

    def expect(self, info: TransferInfo) -> None:
        self.expected.append(info.transfer)

    def received(self, transfer: str) -> int:
        return 3


def _info(transfer: str) -> TransferInfo:
    return TransferInfo(
        federation="lab", round=0, device="d", transfer=transfer, count=1, size=1, chunk=1024, sha256="0" * 64
    )


def _finished(transfer: str, payload: bytes | None = b"x", status: Status = Status.COMPLETE) -> Progress:
    return Progress(_info(transfer), 0, status, payload, "" if payload else "sha256 mismatch")


def test_a_transfer_wait_keeps_the_other_transfers_that_finish_meanwhile_for_their_own_wait() -> None:
    receiver = _FakeReceiver(_finished("model", b"onnx"), _finished("routed", b"weights"))
    downloads = Downloads(receiver)  # type: ignore[arg-type]
    assert downloads.wait(_info("routed"), time.monotonic() + 5, lambda: False) == b"weights"
    assert downloads.wait(_info("model"), time.monotonic() + 0.01, lambda: False) == b"onnx"
    assert receiver.expected == ["routed", "model"]  # each wait nacks its transfer's missing chunks from the start


def test_a_transfer_wait_ends_when_abandoned_rejected_or_late_and_reports_progress_meanwhile() -> None:
    reports: list[int] = []
    downloads = Downloads(_FakeReceiver())  # type: ignore[arg-type]
    began = time.monotonic()
    assert downloads.wait(_info("routed"), began + 30, lambda: time.monotonic() - began > 1.5, reports.append) is None
    assert time.monotonic() - began < 5 and reports == [3, 3]  # at once, then after a second
    assert downloads.wait(_info("routed"), time.monotonic() + 0.3, lambda: False) is None
    rejected = Downloads(_FakeReceiver(_finished("routed", None, Status.REJECTED)))  # type: ignore[arg-type]
    assert rejected.wait(_info("routed"), time.monotonic() + 5, lambda: False) is None


@pytest.mark.slow  # several seconds (processes, a federation or a real simulation): out of the fast loop
def test_a_newer_round_ends_the_wait_for_a_payload_that_never_came(
    federation: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent reports its download progress, gives up the first round as soon as the second arrives (not at its
    60 s deadline), and then waits for the second."""
    agent = Agent(
        AgentConfig(host="slow", federation=federation, budget_macs=BUDGET),
        LinkConfig(broker="mqtt://127.0.0.1:1883"),
        [_client("slow")],
    )
    agent.start(timeout=5)
    runner = threading.Thread(target=agent.run, daemon=True)
    server = Link(LinkConfig(broker="mqtt://127.0.0.1:1883"))
    metrics: list[Metrics] = []
    server.subscribe(Topics(federation).events("slow"), lambda r: metrics.append(parse(r.payload)))  # type: ignore[arg-type]
    server.connect(timeout=5)
    caplog.set_level(logging.INFO, logger="feast_edge.agent")
    runner.start()
    try:
        for t, timeout in ((0, 60.0), (1, 3.0)):
            start, _ = _round("slow", t=t, timeout=timeout, federation=federation, instance=agent.instance)
            server.publish(Topics(federation).ctrl("slow"), start.encode(), timeout=5)  # and never the chunks
            time.sleep(2.5)
        began = time.monotonic()
        while time.monotonic() - began < 10 and "round 2/2: no routed payload for slow" not in caplog.text:
            time.sleep(0.1)
    finally:
        agent.stop.set()
        runner.join(10)
        server.close()
        agent.close()
    assert (
        "round 1/2: no routed payload for slow" in caplog.text
        and "round 2/2: no routed payload for slow" in caplog.text
    )
    downloading = [m.values for m in metrics if isinstance(m, Metrics) and m.values.get("phase") == "downloading"]
    assert {v["round"] for v in downloading} == {0, 1} and len(downloading) >= 4, downloading


@pytest.mark.parametrize("stay", [False, True])
def test_an_agent_says_it_leaves_or_that_it_waits_for_the_next_run_never_both(
    stay: bool, federation: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: the end of the federation came while the agent exported and timed its model; it said "finished ...;
    leaving", then "waiting for the server's next run" (a heartbeat was due since the export began), then left."""
    monkeypatch.setattr("feast_edge.agent.agent.HEARTBEAT", 0.3)
    config = AgentConfig(host="end", federation=federation, budget_macs=BUDGET, stay=stay)
    agent = Agent(config, LinkConfig(broker="mqtt://127.0.0.1:1883"), [_client("end")])  # never connects
    topics, link = Topics(federation), _FakeLink()
    agent.inbox.subscribe(link, ["end"], "end", on_own_offline=lambda: None)  # type: ignore[arg-type]
    end = Finished(federation=federation, round=0, device="end", rounds=1, completed=1, instance=agent.instance)

    def export_and_time(model: object) -> None:  # the server's end arrives meanwhile, as paho delivers it
        time.sleep(0.8)
        link.handlers[topics.ctrl("end")](Received(topics.ctrl("end"), end.encode()))

    agent._receive_model = export_and_time  # type: ignore[method-assign]
    agent._models.append(SimpleNamespace(device="end"))  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="feast_edge.agent")
    runner = threading.Thread(target=agent.run, daemon=True)
    runner.start()
    runner.join(3.0)
    left = not runner.is_alive()
    agent.stop.set()
    runner.join(5.0)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("feast_edge.agent")]
    finished = [line for line in lines if "finished after 1 of 1 rounds" in line]
    waiting = [line for line in lines if line.startswith("waiting for the server's next run")]
    assert len(finished) == 1 and left is not stay, lines
    if stay:
        assert not finished[0].endswith("leaving") and waiting, lines
    else:
        assert finished[0].endswith("; leaving") and not [line for line in lines if line.startswith("waiting")], lines
