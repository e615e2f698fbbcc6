"""Who may be in the federation: registrations and presence, in any restart order (server/devices.py, over a real registry)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from feast_edge.cache.variants import load_cache
from feast_edge.protocol import Register, Registered
from feast_edge.server.devices import DeviceBook
from feast_edge.server.registry import Registry
from feast_edge.space.preset import load_preset
from feast_edge.transport.messages import Presence

PRESET = load_preset("fmnist-small")


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(tmp_path / "devices.sqlite")


def _book(registry: Registry, replies: list[Registered]) -> DeviceBook:
    return DeviceBook(
        registry,
        PRESET,
        load_cache(PRESET),
        federation="lab",
        rounds=3,
        reply=lambda device, message: replies.append(message),
    )


def _register(
    book: DeviceBook,
    device: str,
    instance: str,
    host: str | None = None,
    samples: int = 50,
    precision: str = "fp32",
    holdout: int = 0,
    **more: object,
) -> None:
    book.on_register(
        Register.for_client(
            federation="lab",
            device_id=device,
            host=host or device,
            instance=instance,
            preset=PRESET,
            budget_macs=6_000_000,
            samples=samples,
            profile={},
            precision=precision,
            holdout=holdout,
            **more,
        )
    )


def test_the_protocol_features_an_agent_lists_are_kept_and_one_that_lists_none_has_none(registry: Registry) -> None:
    book = _book(registry, [])
    _register(book, "new", "i1")  # this version's agent: its features by default
    _register(book, "newer", "i2", features=("evaluate-candidates", "a-feature-of-later-agents"))
    _register(book, "old", "i3", features=())  # an agent from before protocol features
    _register(book, "liar", "i4", features=())
    assert book.supports("new", "evaluate-candidates") and book.supports("newer", "evaluate-candidates")
    assert not book.supports("old", "evaluate-candidates") and not book.supports("unregistered", "evaluate-candidates")
    # A registration's free-form profile cannot claim a feature: the registered list is the message's own field.
    book.on_register(
        Register.for_client(
            federation="lab", device_id="liar", host="liar", instance="i4", preset=PRESET, budget_macs=6_000_000,
            samples=50, profile={"features": ["evaluate-candidates"]}, features=(),
        )
    )  # fmt: skip
    assert not book.supports("liar", "evaluate-candidates")


def _online(book: DeviceBook, host: str) -> None:
    book.on_presence(Presence(federation="lab", round=0, device=host, state="online"))


def test_an_agent_back_before_the_server_replaces_its_own_stale_registration(registry: Registry) -> None:
    replies: list[Registered] = []
    first = _book(registry, replies)
    _online(first, "pi")
    _register(first, "pi", "before-the-stop")
    assert replies[-1].accepted
    # Everything stops; the agent comes back first (its retained presence is online), then the server restarts.
    restarted = _book(registry, replies)
    _online(restarted, "pi")
    _register(restarted, "pi", "after-the-stop")
    assert replies[-1].accepted, replies[-1].reason
    assert registry.get("pi").instance == "after-the-stop"
    # Once it registered with this server, a second agent claiming the id while it is online is refused.
    _register(restarted, "pi", "an-impostor")
    assert not replies[-1].accepted and "already online" in replies[-1].reason


def test_a_device_whose_host_left_may_be_taken_over(registry: Registry) -> None:
    replies: list[Registered] = []
    book = _book(registry, replies)
    _online(book, "pi")
    _register(book, "pi", "one")
    book.on_presence(Presence(federation="lab", round=0, device="pi", state="offline"))
    _online(book, "pi")
    _register(book, "pi", "two")
    assert replies[-1].accepted and registry.get("pi").instance == "two"


def test_a_finished_federation_says_so_to_a_late_device(registry: Registry) -> None:
    replies: list[Registered] = []
    book = _book(registry, replies)
    book.finished = True
    _register(book, "late", "x")
    assert replies[-1].accepted and replies[-1].finished and replies[-1].rounds == 3


def test_the_registered_sample_count_is_bounded_by_the_servers_own_record(registry: Registry) -> None:
    """The count a device registers bounds its aggregation weight: its shard's size where the server knows it, --max-samples elsewhere."""
    replies: list[Registered] = []
    book = DeviceBook(
        registry,
        PRESET,
        load_cache(PRESET),
        federation="lab",
        rounds=3,
        reply=lambda device, message: replies.append(message),
        max_samples=1000,
        shard_samples={"client-000": 120},
    )
    _register(book, "client-000", "i1", samples=121)
    _register(book, "client-000", "i2", samples=120)
    _register(book, "stranger", "i3", samples=2**53)
    _register(book, "laptop", "i4", samples=1000)
    assert [r.accepted for r in replies] == [False, True, False, True]
    assert "its shard in the server's partition holds at most 120" in replies[0].reason
    assert "--max-samples allows at most 1000" in replies[2].reason


def test_a_held_out_split_larger_than_the_device_can_hold_is_refused(registry: Registry) -> None:
    """Issue 35: a device registered 10^12 held-out examples (bounded only by 2^40) and weighed validation with them."""
    replies: list[Registered] = []
    book = DeviceBook(
        registry, PRESET, load_cache(PRESET), federation="lab", rounds=3, reply=lambda d, m: replies.append(m),
        max_samples=1000,
    )  # fmt: skip
    _register(book, "liar", "i1", samples=50, holdout=10**12)
    _register(book, "greedy", "i2", samples=100, holdout=1001)  # over --max-samples
    _register(book, "pi", "i3", samples=50, holdout=16 * 50)  # what --holdout 0.9 can give, at worst
    _register(book, "laptop", "i4", samples=900, holdout=100)  # the default 10 %
    assert [r.accepted for r in replies] == [False, False, True, True]
    assert "registers 1000000000000 held-out examples beside 50 training examples; at most 800" in replies[0].reason
    assert "at most 1000 are believable" in replies[1].reason


def test_per_class_counts_must_match_the_task_and_add_up_to_the_registered_totals(registry: Registry) -> None:
    """A provisioned device that lies about its classes (issue 37): counts for another task, or that do not add up."""
    replies: list[Registered] = []
    book = _book(registry, replies)
    classes = PRESET.classes

    def register(device: str, counts: tuple[int, ...], held: tuple[int, ...] = ()) -> None:
        message = Register.for_client(
            federation="lab",
            device_id=device,
            host=device,
            instance="i",
            preset=PRESET,
            budget_macs=6_000_000,
            samples=50,
            profile={"class_counts": [10**9] * classes},  # a profile cannot smuggle counts in: the fields replace it
            holdout=sum(held),
            class_counts=counts,
            holdout_counts=held,
        )
        book.on_register(message)

    register("short", (25, 25))
    register("inflated", (50,) * classes)
    register("held", (5,) * classes, (1, 0, 1) + (0,) * (classes - 3) + (9,))
    register("honest", (50,) + (0,) * (classes - 1), (2,) + (0,) * (classes - 1))
    register("older", ())  # an agent before per-class counts: accepted, coverage leaves it out
    assert [r.accepted for r in replies] == [False, False, False, True, True]
    assert f"registers 2 per-class training counts; the task has {classes} classes" in replies[0].reason
    assert (
        f"per-class training counts sum to {50 * classes}, but it registers 50 training examples" in replies[1].reason
    )
    assert "held-out counts" in replies[2].reason
    honest = registry.get("honest")
    assert honest is not None and honest.profile["class_counts"] == [50] + [0] * (classes - 1)
    assert (
        honest.profile["holdout_counts"] == [2] + [0] * (classes - 1) and honest.profile["evaluate_macs"] == 6_000_000
    )


def test_count_lists_are_bounded_and_typed_before_anything_reads_them() -> None:
    import json

    from feast_edge.protocol.limits import MAX_CLASSES
    from feast_edge.transport.errors import ProtocolError
    from feast_edge.transport.messages import parse

    base = json.loads(
        Register.for_client(
            federation="lab", device_id="x", host="x", instance="i", preset=PRESET, budget_macs=1, samples=1, profile={}
        ).encode()
    )
    assert parse(json.dumps({**base, "class_counts": [3, 0]}).encode()).class_counts == (3, 0)
    # As they arrive from the network: parsed and refused before any server code reads them.
    for bad in ([1] * (MAX_CLASSES + 1), [-1], ["3"], [True], [1.5], {"a": 1}, 7, [2**41]):
        with pytest.raises(ProtocolError):
            parse(json.dumps({**base, "class_counts": bad}).encode())
    for bad in (-5, "8M", 2**41):
        with pytest.raises(ProtocolError):
            parse(json.dumps({**base, "evaluate_macs": bad}).encode())


def test_a_provisioned_device_registers_as_itself_only(registry: Registry) -> None:
    replies: list[Registered] = []
    book = DeviceBook(
        registry,
        PRESET,
        load_cache(PRESET),
        federation="lab",
        rounds=3,
        reply=lambda device, message: replies.append(message),
        authenticated=True,
    )
    _register(book, "jet", "i1", host="pi")
    _register(book, "jet", "i2")
    assert [r.accepted for r in replies] == [False, True]
    assert "registers as itself" in replies[0].reason


def test_the_registry_is_bounded(registry: Registry) -> None:
    replies: list[Registered] = []
    book = DeviceBook(
        registry,
        PRESET,
        load_cache(PRESET),
        federation="lab",
        rounds=3,
        reply=lambda device, message: replies.append(message),
        max_devices=3,
    )
    for i in range(5):
        _register(book, f"d{i}", f"i{i}")
    _register(book, "d0", "i9")  # a device already registered may come back
    assert [r.accepted for r in replies] == [True, True, True, False, False, True]
    assert "maximum of 3 registered devices (--max-devices)" in replies[3].reason
    assert registry.count() == 3


def test_after_the_servers_link_came_back_a_new_instance_may_take_over(registry: Registry) -> None:
    """An agent that died while the broker was down never sent its last will: after the reconnect its id is free again."""
    replies: list[Registered] = []
    book = _book(registry, replies)
    _online(book, "jet")
    _register(book, "jet", "old")
    _register(book, "jet", "new")
    assert [r.accepted for r in replies] == [True, False]  # the old instance is online: a second one is refused
    book.on_reconnect()
    assert book.online() == []  # the statuses that follow the new subscription say who is online
    _register(book, "jet", "new")
    _online(book, "jet")
    assert replies[-1].accepted and book.online() == ["jet"]


def test_the_server_announces_its_task_and_refuses_a_device_checked_against_another(registry: Registry) -> None:
    import dataclasses

    from feast_edge.data.task import Task

    replies: list[Registered] = []
    book = _book(registry, replies)
    _online(book, "cam")
    _register(book, "cam", "one")
    assert replies[-1].accepted and Task.from_dict(replies[-1].task) == PRESET.task
    assert replies[-1].validation == "server"
    # Same tensors (same preset digest), other class names: another task, refused before it trains.
    renamed = dataclasses.replace(PRESET, class_names=tuple(f"c{i}" for i in range(10)))
    assert renamed.digest == PRESET.digest and renamed.task.digest != PRESET.task.digest
    book.on_register(
        Register.for_client(
            federation="lab",
            device_id="other",
            host="cam",
            instance="two",
            preset=renamed,
            budget_macs=6_000_000,
            samples=50,
            profile={},
        )
    )
    assert not replies[-1].accepted and "task mismatch" in replies[-1].reason and "--preset" in replies[-1].reason
    assert registry.get("other") is None


def test_an_agent_leaves_a_federation_that_trains_another_task() -> None:
    import dataclasses

    from feast_edge.agent.config import AgentConfig
    from feast_edge.agent.registration import AgentError, Registration
    from feast_edge.transport.topics import Topics

    registration = Registration(AgentConfig(host="cam", federation="lab"), PRESET, "inst", None, Topics("lab"), {})
    ours = Registered(
        federation="lab", round=0, device="cam", instance="inst", accepted=True, task=PRESET.task.to_dict()
    )
    registration.on_registered(ours)
    assert "cam" in registration.accepted
    theirs = dataclasses.replace(PRESET.task, resize="center-crop")
    with pytest.raises(AgentError, match="the federation trains task 1x28x28 \\(center-crop\\).*--preset"):
        registration.on_registered(dataclasses.replace(ours, task=theirs.to_dict(), msg_id="m2"))
    with pytest.raises(AgentError, match="malformed task"):
        registration.on_registered(dataclasses.replace(ours, task={"channels": 2}, msg_id="m3"))


def test_the_registered_precision_is_stored_and_survives_a_restart(registry: Registry, tmp_path: Path) -> None:
    replies: list[Registered] = []
    book = _book(registry, replies)
    _register(book, "pi", "one", precision="int8")
    _register(book, "cam", "two")
    assert [r.accepted for r in replies] == [True, True]
    assert (registry.get("pi").precision, registry.get("cam").precision) == ("int8", "fp32")
    assert {d["device_id"]: d["precision"] for d in registry.snapshot()} == {"cam": "fp32", "pi": "int8"}
    registry.close()
    reopened = Registry(tmp_path / "devices.sqlite", readonly=True)
    assert reopened.get("pi").precision == "int8"
    reopened.close()
    again = Registry(tmp_path / "devices.sqlite")
    _register(_book(again, replies), "pi", "three")  # re-profiled in float32: the registration says so
    assert again.get("pi").precision == "fp32"


def test_a_registry_from_before_the_precision_column_reads_as_float32(tmp_path: Path) -> None:
    import sqlite3

    from feast_edge.server import registry as registry_module

    path = tmp_path / "devices.sqlite"
    old = sqlite3.connect(str(path))
    old.executescript(registry_module.SCHEMA.replace(",\n    precision   TEXT NOT NULL DEFAULT 'fp32'", ""))
    old.execute(
        "INSERT INTO devices (device_id, host, instance, budget_macs, samples, preset, profile, first_seen, last_seen, "
        "status) VALUES ('pi', 'pi', 'i', 6000000, 50, 'fmnist-small', '{}', 1.0, 1.0, 'offline')"
    )
    old.commit()
    assert "precision" not in {row[1] for row in old.execute("PRAGMA table_info(devices)")}
    old.close()
    readonly = Registry(path, readonly=True)  # feast-server status on an old run: nothing written
    assert readonly.get("pi").precision == "fp32"
    readonly.close()
    upgraded = Registry(path)  # a server resuming the run adds the column
    assert upgraded.get("pi").precision == "fp32"
    _register(_book(upgraded, []), "pi", "i", precision="int8")
    assert upgraded.get("pi").precision == "int8"


def test_an_agent_registers_the_precision_of_its_profile() -> None:
    from types import SimpleNamespace

    from feast_edge.agent.config import AgentConfig
    from feast_edge.agent.registration import Registration
    from feast_edge.transport.messages import parse
    from feast_edge.transport.topics import Topics

    sent: list[bytes] = []
    link = SimpleNamespace(publish=lambda topic, data: sent.append(data))
    labels = torch.tensor([3] * 30 + [7] * 20)
    data = SimpleNamespace(samples=50, holdout=2, labels=labels, holdout_labels=torch.tensor([3, 3]))
    client = SimpleNamespace(budget_macs=6_000_000, data=data, current=data)  # Hosted.current: its newest data
    config = AgentConfig(host="cam", federation="lab", precision="int8")
    Registration(config, PRESET, "inst", link, Topics("lab"), {"cam": client}).send()
    [message] = [parse(data) for data in sent]
    assert isinstance(message, Register) and message.precision == "int8"
    # Counts only, per class of the task: 30 of class 3 and 20 of class 7 train; two of class 3 are held out.
    assert message.class_counts == tuple(30 if k == 3 else 20 if k == 7 else 0 for k in range(PRESET.classes))
    assert message.holdout_counts == tuple(2 if k == 3 else 0 for k in range(PRESET.classes))
    assert message.evaluate_macs == 6_000_000  # no evaluation limit given: its budget
