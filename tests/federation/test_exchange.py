"""The round exchange on its own: bytes and messages out, settled replies back, with no broker and no FEAST payload."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable

from feast_edge.protocol import Declined, Update
from feast_edge.server.exchange import ExchangeSettings, Expect, RoundExchange
from feast_edge.server.jobs import JobExchange
from feast_edge.transport.chunks import Progress, Reassembler, Status
from feast_edge.transport.errors import LinkError
from feast_edge.transport.frames import TransferInfo, describe
from feast_edge.transport.messages import Message, Presence
from feast_edge.transport.topics import Topics

FED = "lab"


class Sender:
    """Records what goes out; devices named in ``broken`` cannot be reached."""

    def __init__(self, broken: tuple[str, ...] = ()) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.broken = broken

    def describe(self, payload: bytes, *, round: int, device: str) -> TransferInfo:
        return describe(payload, federation=FED, round=round, device=device)

    def announce_and_send(
        self, topic: str, announcement: bytes, payload: bytes, info: TransferInfo, timeout: float
    ) -> TransferInfo:
        if info.device in self.broken:
            raise LinkError("the broker went away")
        self.sent.append((topic, payload))
        return info


class Receiver:
    """Finished uploads arrive in ``results``, as the chunk receiver puts them there."""

    def __init__(self) -> None:
        self.reassembler = Reassembler(federation=FED, expected_only=True)
        self.results: queue.Queue[Progress] = queue.Queue()
        self.expected: list[str] = []

    def expect(self, info: TransferInfo) -> None:
        self.expected.append(info.transfer)
        self.reassembler.expect(info)

    def poll(self) -> None:
        pass


class Script:
    """The event loop: each pump runs the next scripted step (what the network delivers meanwhile)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.steps: list[Callable[[], None]] = []
        self.exchange: RoundExchange | None = None

    def pump(self, seconds: float) -> None:
        assert self.exchange is not None
        self.exchange.tick()
        if seconds and self.steps:
            self.steps.pop(0)()


def _exchange(timeout: float = 2.0, broken: tuple[str, ...] = ()) -> tuple[RoundExchange, Sender, Receiver, Script]:
    sender, receiver, script = Sender(broken), Receiver(), Script()
    exchange = RoundExchange(Topics(FED), sender, receiver, script, ExchangeSettings(rounds=3, round_timeout=timeout))  # type: ignore[arg-type]
    script.exchange = exchange
    return exchange, sender, receiver, script


def _send(
    exchange: RoundExchange, devices: list[str], payload: bytes = b"routed bytes", samples: int = 10
) -> dict[str, TransferInfo]:
    sent = {}
    for device in devices:
        info = sent[device] = exchange.describe(device, payload)
        message: Message = Presence(
            federation=FED, round=0, device=device, state="online"
        )  # any message: the exchange only sends it
        exchange.send(device, message, payload, info, Expect(max_bytes=len(payload) + 8, max_samples=samples))
    return sent


def _upload(device: str, routed: TransferInfo, payload: bytes, samples: int = 5) -> tuple[Update, Progress]:
    info = describe(payload, federation=FED, round=routed.round, device=device)
    update = Update(
        federation=FED,
        round=routed.round,
        device=device,
        transfer=info.to_dict(),
        routed=routed.transfer,
        samples=samples,
    )
    return update, Progress(info, info.count - 1, Status.COMPLETE, payload=payload)


def test_each_reply_settles_once_and_a_silent_or_offline_device_is_reported() -> None:
    exchange, sender, receiver, script = _exchange(timeout=1.0)
    exchange.open(0)
    routed = _send(exchange, ["a", "b", "c", "d", "e", "f", "g"])
    assert [topic for topic, _ in sender.sent] == [f"feast/{FED}/ctrl/{d}" for d in "abcdefg"]
    a, a_done = _upload("a", routed["a"], b"a's bytes")
    b, b_done = _upload("b", routed["b"], b"b's bytes")
    f, _ = _upload("f", routed["f"], b"f's bytes")  # announced; its chunks never come
    g, g_done = _upload("g", routed["g"], b"g's bytes")
    g_corrupt = Progress(g_done.info, g_done.index, Status.REJECTED, reason="sha256 mismatch: received payload ...")
    script.steps = [
        lambda: (exchange.on_update(a), receiver.results.put(a_done)),
        lambda: receiver.results.put(b_done),  # b's upload finished before its announcement came
        lambda: exchange.on_update(b),
        lambda: exchange.on_update(a),  # a duplicate
        lambda: exchange.on_declined(
            Declined(federation=FED, round=0, device="c", routed=routed["c"].transfer, reason="diverged")
        ),
        lambda: exchange.on_offline(["d"]),
        lambda: exchange.on_update(f),
        lambda: (exchange.on_update(g), receiver.results.put(g_corrupt)),
    ]
    replies = list(exchange.replies())
    assert [(r.device, r.payload, r.error, r.outcome) for r in replies] == [
        ("a", b"a's bytes", "", ""),
        ("b", b"b's bytes", "", ""),
        ("c", None, "the device sent no update: diverged", "declined"),
        ("g", None, "sha256 mismatch: received payload ...", "rejected"),
        ("f", None, "its announced upload (9 bytes) did not complete before the round's deadline", "incomplete"),
    ]
    unsettled = exchange.close()
    assert unsettled.missing == ["e"] and unsettled.dropped == ["d"]
    assert len(unsettled.ignored) == 1 and "duplicate" in unsettled.ignored[0]
    exchange.on_update(a)  # after the round: ignored, and nothing is in flight any more
    assert exchange.current is None and exchange.announced == {}


def test_an_announcement_outside_its_bounds_is_refused_before_its_bytes_are_taken() -> None:
    exchange, _, receiver, script = _exchange()
    exchange.open(0)
    routed = _send(exchange, ["big", "heavy"], payload=b"12345678", samples=10)
    big, _ = _upload("big", routed["big"], b"x" * 100)
    heavy, _ = _upload("heavy", routed["heavy"], b"y", samples=11)
    script.steps = [lambda: exchange.on_update(big), lambda: exchange.on_update(heavy)]
    errors = {r.device: r.error for r in exchange.replies()}
    assert "declares 100 bytes" in errors["big"] and "at most 16" in errors["big"]
    assert "claims 11 samples" in errors["heavy"] and "between 1 and the 10" in errors["heavy"]
    assert receiver.expected == [] and receiver.reassembler.active() == []
    assert exchange.close().missing == []


def test_a_device_the_link_cannot_reach_fails_at_once_and_the_others_go_on() -> None:
    exchange, sender, _, script = _exchange(timeout=0.3, broken=("gone",))
    exchange.open(0)
    routed = _send(exchange, ["gone", "ok"])
    ok, ok_done = _upload("ok", routed["ok"], b"fine")
    script.steps = [lambda: (exchange.on_update(ok), exchange.receiver.results.put(ok_done))]
    replies = list(exchange.replies())
    assert [topic for topic, _ in sender.sent] == [f"feast/{FED}/ctrl/ok"] and [r.device for r in replies] == [
        "gone",
        "ok",
    ]
    assert replies[0].error.startswith("could not send its routed payload") and replies[1].payload == b"fine"
    assert replies[0].outcome == "incomplete"


def test_uploads_of_another_round_or_transfer_are_not_taken() -> None:
    exchange, _, _, script = _exchange(timeout=0.3)
    exchange.open(1)
    routed = _send(exchange, ["a"])
    stale, _ = _upload("a", dataclasses.replace(routed["a"], round=0), b"old")
    wrong = Update(
        federation=FED, round=1, device="a", transfer=routed["a"].to_dict(), routed="not-the-routed-one", samples=1
    )
    script.steps = [lambda: exchange.on_update(stale), lambda: exchange.on_update(wrong)]
    assert list(exchange.replies()) == []
    ignored = exchange.close().ignored
    assert "round 1 is not the round in flight" in ignored[0] and "not this round's" in ignored[1]


def test_an_evaluation_request_settles_on_its_counts_and_nothing_else() -> None:
    from feast_edge.protocol import Evaluated

    exchange, _, receiver, script = _exchange(timeout=1.0)
    exchange.open(4)
    sent = {}
    for device in ("a", "b", "c"):
        info = sent[device] = exchange.describe(device, b"the model to validate")
        exchange.send(
            device, Presence(federation=FED, round=4, device=device, state="online"), b"x", info, Expect(0, 0)
        )

    def answer(device: str, routed: str, round: int = 4) -> Evaluated:
        return Evaluated(federation=FED, round=round, device=device, routed=routed, results=(3, 4), calibrated_on=9)

    upload, _ = _upload("c", sent["c"], b"an update where counts are due")
    script.steps = [
        lambda: exchange.on_evaluated(answer("a", sent["a"].transfer)),
        lambda: exchange.on_evaluated(answer("a", sent["a"].transfer)),  # a repeat: ignored
        lambda: exchange.on_evaluated(answer("b", "another-transfer")),  # not what was sent to b: ignored
        lambda: exchange.on_update(upload),  # an upload where only counts are due: refused, takes nothing
    ]
    replies = list(exchange.replies())
    assert [(r.device, r.evaluation.counts() if r.evaluation else None) for r in replies][0] == ("a", [(3, 4)])
    assert replies[1].device == "c" and replies[1].evaluation is None and "evaluation" in replies[1].error
    assert receiver.expected == []  # the upload announced to an evaluation was never taken
    unsettled = exchange.close()
    assert unsettled.missing == ["b"]
    assert len(unsettled.ignored) == 2 and all("does not answer an open evaluation" in i for i in unsettled.ignored)


# --------------------------------------------------------------------------- asynchronous rounds (server.jobs)


def _jobs(timeout: float = 2.0) -> tuple[JobExchange, Receiver, Script]:
    sender, receiver, script = Sender(), Receiver(), Script()
    exchange = JobExchange(Topics(FED), sender, receiver, script, ExchangeSettings(rounds=3, round_timeout=timeout))  # type: ignore[arg-type]
    script.exchange = exchange
    return exchange, receiver, script


def test_requests_of_several_versions_stay_open_and_each_reply_is_matched_to_the_version_its_device_was_sent() -> None:
    exchange, receiver, script = _jobs()
    exchange.open(0, keep=True)
    first = _send(exchange, ["slow", "a"])
    a, a_done = _upload("a", first["a"], b"a at 0")
    script.steps = [lambda: (exchange.on_update(a), receiver.results.put(a_done))]
    assert [(r.device, r.payload) for r in exchange.arrivals(1.0)] == [("a", b"a at 0")]
    # Version 1: a is sent again; slow still trains from version 0, and its request stays open.
    exchange.open(1, keep=True)
    second = _send(exchange, ["a"])
    slow, slow_done = _upload("slow", first["slow"], b"slow at 0")
    a_again, a_again_done = _upload("a", second["a"], b"a at 1")
    replayed, _ = _upload("a", first["a"], b"a at 0, replayed")  # its answer to version 0, sent again
    forged = dataclasses.replace(slow, round=1)  # slow claims the version it was not sent
    script.steps = [
        lambda: exchange.on_update(replayed),
        lambda: exchange.on_update(forged),
        lambda: (exchange.on_update(slow), receiver.results.put(slow_done)),
        lambda: (exchange.on_update(a_again), receiver.results.put(a_again_done)),
    ]
    got = []
    while len(got) < 2:
        got += [(r.device, r.payload) for r in exchange.arrivals(1.0)]
    assert sorted(got) == [("a", b"a at 1"), ("slow", b"slow at 0")]
    ignored = exchange.take_ignored()
    assert len(ignored) == 2, ignored
    assert "update from a: round 1 is not the round in flight" in ignored[0]  # version 0 answered, 1 expected
    assert "update from slow: round 2 is not the round in flight" in ignored[1]
    assert exchange.take_ignored() == [] and exchange.current is not None and exchange.current.pending == {}


def test_a_request_past_its_own_deadline_or_of_a_departed_device_settles_and_frees_its_device() -> None:
    exchange, _, script = _jobs(timeout=0.3)
    exchange.open(0, keep=True)
    _send(exchange, ["silent", "gone"])
    script.steps = [lambda: exchange.on_offline(["gone"])]
    first = exchange.arrivals(0.2)
    assert [(r.device, r.outcome, r.error) for r in first] == [("gone", "dropped", "its host went offline")]
    exchange.open(1, keep=True)  # a later request: its own deadline, 0.3 s from now
    _send(exchange, ["late"])
    settled = []
    while len(settled) < 2:
        settled += [(r.device, r.outcome) for r in exchange.arrivals(0.5)]
    assert settled == [("silent", "missing"), ("late", "missing")]
    assert exchange.current is not None and exchange.current.pending == {}
