"""The agent's side of a secure round (feast_edge.agent.secure_round) in process: three agents' SecureRounds with real
keys, shares and masks, the test as their server, each agent's published messages read back from an outbox in place of
the broker. What it answers, what it refuses, and the reason it logs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from feast_edge.agent.secure_round import SecureRounds
from feast_edge.protocol import (
    RoundStart,
    SecAggBox,
    SecAggKeys,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
)
from feast_edge.protocol.secure import SecureBlock, sealed_wire
from feast_edge.route.envelope import Envelope
from feast_edge.route.payload import expected_shapes
from feast_edge.secagg.sums import SecureTerms, cohort_segments
from feast_edge.space.arch import Arch
from feast_edge.space.preset import load_preset
from feast_edge.transport.frames import describe
from feast_edge.transport.messages import Message, parse
from feast_edge.transport.topics import Topics

PRESET = load_preset("fmnist-small")
FEDERATION = "lab"
NAMES = ("a", "b", "c")


class Outbox:
    """A link that keeps what an agent publishes, parsed, instead of sending it."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def publish(self, topic: str, payload: bytes, **_: object) -> None:
        self.sent.append(parse(payload))

    def first(self, kind: type, timeout: float = 20.0) -> Message:
        """The first ``kind`` message published, waiting for the agent's worker thread to send it."""
        wait_until(lambda: any(isinstance(m, kind) for m in self.sent), timeout, f"no {kind.__name__} sent")
        return next(m for m in self.sent if isinstance(m, kind))


def wait_until(condition: Callable[[], bool], timeout: float, failure: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def round_starts() -> dict[str, RoundStart]:
    """Round 1 (0-based 0) of a secure round of three devices routed the smallest variant, c = 1."""
    arch = Arch.smallest(PRESET)
    cohort = {n: Envelope.of([arch]) for n in NAMES}
    terms = SecureTerms(colluders=1)
    setup = terms.setup(f"{FEDERATION}/round 0", cohort_segments(PRESET, cohort), len(NAMES))
    block = SecureBlock(1, setup.threshold, terms.bound, terms.code(len(NAMES)).frac, cohort, {n: 100 for n in NAMES})
    plan = {"affordable": [arch.to_dict()], "global_min": arch.to_dict()}
    return {
        n: RoundStart(
            federation=FEDERATION,
            round=0,
            device=n,
            instance="i1",
            plan=plan,
            train={},
            transfer=describe(n.encode(), federation=FEDERATION, round=0, device=n).to_dict(),
            deadline=time.time() + 60,
            timeout=60.0,
            rounds=2,
            lr=0.1,
            seed="1",
            secure=block.wire(),
        )
        for n in NAMES
    }


def test_an_agent_answers_one_unmask_request_a_round_and_logs_the_real_reason_it_refuses_another(caplog) -> None:
    caplog.set_level(logging.INFO, logger="feast_edge.agent.secure_round")
    stop = threading.Event()
    starts = round_starts()
    outboxes = {n: Outbox() for n in NAMES}
    agents = {n: SecureRounds(PRESET, outboxes[n], Topics(FEDERATION), stop) for n in NAMES}  # type: ignore[arg-type]

    def stage(kind: type, device: str, **fields: object) -> Message:
        routed = starts[device].transfer["transfer"]
        return kind(federation=FEDERATION, round=0, device=device, routed=routed, **fields)

    def refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]

    try:
        for n in NAMES:
            agents[n].offer(starts[n])
        keys = {n: list(outboxes[n].first(SecAggKeys).keys()) for n in NAMES}
        roster = {n: [c.hex(), s.hex()] for n, (c, s) in keys.items()}
        for n in NAMES:
            agents[n].offer(stage(SecAggRoster, n, keys=roster))
        sealed = {n: outboxes[n].first(SecAggShares).sealed() for n in NAMES}
        for n in NAMES:
            mine = {sender: boxes[n] for sender, boxes in sealed.items() if n in boxes}
            agents[n].offer(stage(SecAggBox, n, shared=NAMES, shares=sealed_wire(mine)))
        shapes = expected_shapes(PRESET, PRESET.classes, Envelope.of([Arch.smallest(PRESET)]))
        base = {k: torch.zeros(s, dtype=torch.long if k.endswith("num_batches_tracked") else torch.float32)
                for k, s in shapes.items()}  # fmt: skip
        trained = {k: v + 0.01 if v.is_floating_point() else v for k, v in base.items()}
        upload = agents["a"].masked_upload(starts["a"], base, trained, time.monotonic() + 20, lambda: False)
        assert isinstance(upload, bytes), upload

        # b is asked before it masked: refused, for that reason.
        agents["b"].offer(stage(SecAggUnmask, "b", masked=NAMES))
        wait_until(lambda: len(refusals()) == 1, 20, "b did not refuse the unmask request")
        assert refusals() == [
            "secure aggregation: secagg_unmask for b refused: "
            + "an unmask request for a round this device sent no masked update in"
        ]
        # a masked: it answers the first request, refuses the second, and logs why (not "no masked update").
        agents["a"].offer(stage(SecAggUnmask, "a", masked=NAMES))
        agents["a"].offer(stage(SecAggUnmask, "a", masked=NAMES))
        wait_until(lambda: len(refusals()) == 2, 20, "a did not refuse the second unmask request")
    finally:
        stop.set()
    assert refusals()[1] == (
        "secure aggregation: secagg_unmask for a refused: a second unmask request for round 1: this device already "
        "revealed its shares for that round and never reveals twice"
    )
    assert sum(isinstance(m, SecAggReveal) for m in outboxes["a"].sent) == 1
    assert not any(isinstance(m, SecAggReveal) for m in outboxes["b"].sent)
