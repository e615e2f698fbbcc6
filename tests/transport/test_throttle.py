"""Rate-limited logging of dropped input: a flood of bad messages becomes a few lines and a count."""

from __future__ import annotations

import logging

import pytest

from feast_edge.transport.throttle import Throttle


def test_a_flood_is_a_few_lines_then_a_count(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING)
    clock = [100.0]
    monkeypatch.setattr("feast_edge.transport.throttle.time.monotonic", lambda: clock[0])
    throttle = Throttle(logging.getLogger("flood"), period=60.0, burst=3)
    logged = [throttle.warning("bad jet", "dropped message %d", i) for i in range(1000)]
    assert sum(logged) == 3 and [r.getMessage() for r in caplog.records if r.name == "flood"] == [
        "dropped message 0",
        "dropped message 1",
        "dropped message 2",
    ]
    assert throttle.warning("bad pi", "another sender")  # each key has its own budget
    clock[0] += 61
    caplog.clear()
    assert throttle.warning("bad jet", "dropped message again")
    assert (
        caplog.records[0].getMessage() == "dropped message again (997 more like this in the last 60 s were not logged)"
    )


def test_memory_stays_bounded_whatever_the_keys() -> None:
    throttle = Throttle(logging.getLogger("keys"), keys=16)
    for i in range(10_000):
        throttle.warning(f"sender-{i}", "x")
    assert len(throttle._windows) == 16


def test_a_flood_over_many_device_ids_is_still_one_key(caplog: pytest.LogCaptureFixture) -> None:
    from feast_edge.transport.throttle import channel_of

    caplog.set_level(logging.WARNING)
    throttle = Throttle(logging.getLogger("ids"), burst=5)
    for i in range(1000):
        throttle.warning(f"malformed {channel_of(f'feast/lab/events/ghost-{i}')}", "dropped malformed message on %s", i)
    assert len(caplog.records) == 5
