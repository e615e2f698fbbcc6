"""Topic names: building, parsing, and refusing ids that would break MQTT topic matching."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from feast_edge.transport.errors import TopicError
from feast_edge.transport.topics import MAX_ID_LENGTH, Topic, Topics, parse_topic, validate_id

IDS = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", min_size=1, max_size=MAX_ID_LENGTH
)


def test_topic_names() -> None:
    t = Topics("lab1")
    assert t.status("jetson-01") == "feast/lab1/status/jetson-01"
    assert t.server_status == "feast/lab1/server/status"
    assert t.register("d") == "feast/lab1/register/d"
    assert t.ctrl("d") == "feast/lab1/ctrl/d"
    assert t.events("d") == "feast/lab1/events/d"
    assert t.events("+") == "feast/lab1/events/+"
    assert t.xfer("down", "d") == "feast/lab1/xfer/down/d"
    assert t.xfer("up", "+") == "feast/lab1/xfer/up/+"
    assert t.nack("up", "d") == "feast/lab1/xfer/nack/up/d"
    assert t.all == "feast/lab1/#"


@given(federation=IDS, device=IDS, direction=st.sampled_from(["down", "up"]))
def test_every_topic_parses_back(federation: str, device: str, direction: str) -> None:
    t = Topics(federation)
    assert t.parse(t.status(device)) == Topic(federation, "status", device)
    assert t.parse(t.server_status) == Topic(federation, "server_status")
    assert t.parse(t.register(device)) == Topic(federation, "register", device)
    assert t.parse(t.ctrl(device)) == Topic(federation, "ctrl", device)
    assert t.parse(t.events(device)) == Topic(federation, "events", device)
    assert t.parse(t.xfer(direction, device)) == Topic(federation, "xfer", device, direction)
    assert t.parse(t.nack(direction, device)) == Topic(federation, "nack", device, direction)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("", "empty"),
        ("a/b", "topic level separator"),
        ("dev+1", "single-level wildcard"),
        ("dev#", "multi-level wildcard"),
        ("x" * (MAX_ID_LENGTH + 1), "limit is 64"),
        ("späti", "contains 'ä'"),
        ("two words", "contains ' '"),
        ("$SYS", r"contains '\$'"),
    ],
)
def test_bad_ids_are_refused_with_the_reason(value: str, needle: str) -> None:
    with pytest.raises(TopicError, match=needle):
        validate_id(value, "device id")
    with pytest.raises(TopicError):
        Topics("lab").status(value)


def test_non_string_id_is_refused() -> None:
    with pytest.raises(TopicError, match="must be a string"):
        validate_id(7, "device id")


@pytest.mark.parametrize(
    "topic",
    [
        "other/lab/events",
        "feast/lab",
        "feast/lab/unknown",
        "feast/lab/xfer/sideways/d",
        "feast/lab/ctrl/a/b",
        "feast/l+b/events/d",
        "feast/lab/events",
        "feast/lab/register",
    ],
)
def test_foreign_topics_do_not_parse(topic: str) -> None:
    with pytest.raises(TopicError):
        parse_topic(topic)


def test_topic_of_another_federation_is_refused() -> None:
    with pytest.raises(TopicError, match="belongs to federation 'other'"):
        Topics("lab").parse("feast/other/events/d")


def test_bad_direction() -> None:
    with pytest.raises(TopicError, match="'down' or 'up'"):
        Topics("lab").xfer("sideways", "d")
