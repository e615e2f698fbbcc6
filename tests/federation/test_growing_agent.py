"""Folders that grow, on the agent and the server: new images picked up between rounds (feast_edge.agent.growth), their
counts registered again and bounded by the server (server/devices.py), a refused class folder said once, and an image
added between rounds trained on in a later round."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.agent.config import AgentConfig
from feast_edge.agent.growth import FolderWatch
from feast_edge.agent.hosted import Hosted
from feast_edge.agent.local_data import load_clients
from feast_edge.agent.registration import Registration
from feast_edge.cache.variants import load_cache
from feast_edge.protocol import Register, Registered
from feast_edge.server.devices import DeviceBook
from feast_edge.server.registry import Registry
from feast_edge.space.preset import load_preset
from feast_edge.transport.messages import parse
from feast_edge.transport.topics import Topics
from strategies import FMNIST_TINY

PRESET = load_preset(str(FMNIST_TINY))
TASK = PRESET.task
CACHE = load_cache(PRESET)


def _write(root: Path, classes: tuple[str, ...], start: int, count: int) -> None:
    """``count`` distinct 10x10 grey images per class of ``classes``, numbered from ``start``."""
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(start, start + count):
            pixels = np.random.default_rng([i, len(name)]).integers(0, 256, (10, 10), np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEAST_EDGE_DATA_CACHE", str(tmp_path / "decoded"))


def _hosted(root: Path, device: str = "cam") -> Hosted:
    (client,) = load_clients(root, device, task=TASK)
    return Hosted(client, CACHE.smallest.macs, None, None, None)  # type: ignore[arg-type]  # no link: no transfers


def _poll(watch: FolderWatch) -> list:
    return watch.poll(time.monotonic() + 3600)  # as if the interval had passed


def test_the_watch_reads_a_grown_folder_again_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "cam"
    _write(root, ("Bag", "Coat"), 0, 10)
    hosted = _hosted(root)
    watch = FolderWatch({"cam": hosted}, every=60.0)
    assert watch.poll(time.monotonic()) == []  # not due yet
    assert _poll(watch) == []  # due, but nothing changed: nothing read
    decoded: list[int] = []
    real = __import__("feast_edge.data.loaded", fromlist=["decode_into"]).decode_into
    monkeypatch.setattr(
        "feast_edge.data.loaded.decode_into",
        lambda out, items, *a, **k: decoded.append(len(items)) or real(out, items, *a, **k),
    )
    _write(root, ("Bag", "Coat", "Sandal"), 10, 3)  # three new images of two classes, three of a class new to it
    (grown,) = _poll(watch)
    assert decoded == [9]  # the new files only
    assert grown.after.samples + grown.after.holdout == 29 and 5 in grown.after.classes_present  # Sandal is class 5
    assert grown.before is hosted.data and grown.after.growing.key != hosted.data.growing.key
    assert FolderWatch({"cam": hosted}, every=0).poll(time.monotonic() + 3600) == []  # --rescan 0: read once


def test_a_class_folder_the_preset_lacks_is_refused_once_and_its_images_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cam"
    _write(root, ("Bag",), 0, 6)
    hosted = _hosted(root)
    watch = FolderWatch({"cam": hosted}, every=60.0)
    _write(root, ("Wasp",), 0, 4)
    with caplog.at_level(logging.WARNING, logger="feast_edge.agent.growth"):
        assert _poll(watch) == []  # its images are ignored: the listing of the task's classes did not change
        assert _poll(watch) == []
    (line,) = [r.getMessage() for r in caplog.records]  # said once
    assert "refused class folder Wasp/" in line and "T-shirt_top, Trouser" in line and "its images are ignored" in line
    _write(root, ("Bag",), 6, 1)
    (grown,) = _poll(watch)  # the agent goes on: a new image of a task class is read
    assert grown.after.samples + grown.after.holdout == 7 and grown.after.classes_present == (8,)
    shutil.rmtree(root)  # a folder that cannot be read: a warning, and the client keeps its images
    with caplog.at_level(logging.WARNING, logger="feast_edge.agent.growth"):
        assert _poll(watch) == []
    assert "could not read" in caplog.records[-1].getMessage() and "keeps the images it has" in caplog.text


def _registration(hosted: Hosted, sent: list[Register]) -> Registration:
    link = SimpleNamespace(publish=lambda topic, data: sent.append(parse(data)))
    config = AgentConfig(host="cam", federation="lab", preset=str(FMNIST_TINY))
    registration = Registration(config, PRESET, "inst", link, Topics("lab"), {"cam": hosted})
    registration.server_online = True
    return registration


def _answer(accepted: bool = True, reason: str = "") -> Registered:
    return Registered(
        federation="lab", round=0, device="cam", instance="inst", accepted=accepted, reason=reason, task=TASK.to_dict()
    )


def test_staged_images_train_from_the_rounds_after_the_server_accepted_their_counts(tmp_path: Path) -> None:
    root = tmp_path / "cam"
    _write(root, ("Bag",), 0, 20)
    hosted = _hosted(root)
    sent: list[Register] = []
    registration = _registration(hosted, sent)
    registration.send()
    registration.on_registered(_answer(), number=1)
    _write(root, ("Bag", "Coat"), 20, 10)
    (grown,) = _poll(FolderWatch({"cam": hosted}, every=60.0))
    hosted.staged = grown.after  # what Agent._grown does with more images than registered
    registration.update("cam")
    assert sent[-1].samples == grown.after.samples > sent[0].samples  # the new counts, per class too
    assert sent[-1].class_counts[4] > 0 and sum(sent[-1].class_counts) == sent[-1].samples
    assert hosted.data is grown.before  # still the registered images
    registration.on_registered(_answer(), number=7)
    assert not hosted.settle(5)  # a round that came before the answer may expect the old count: old images
    assert hosted.settle(8) and hosted.data is grown.after and hosted.staged is None  # one after it: the new ones
    # A refused update (e.g. past --max-samples) leaves the client as it was, registered and running.
    _write(root, ("Bag",), 30, 40)
    (more,) = _poll(FolderWatch({"cam": hosted}, every=60.0))
    hosted.staged = more.after
    registration.update("cam")
    registration.on_registered(_answer(False, "the device registers 101 training examples; --max-samples ..."), 9)
    assert hosted.data.samples == grown.after.samples and hosted.staged is None and "cam" in registration.accepted
    assert hosted.data.growing.key == more.after.growing.key  # that listing is not read again until it changes


def _book(registry: Registry, replies: list[Registered], max_samples: int = 100) -> DeviceBook:
    return DeviceBook(
        registry,
        PRESET,
        CACHE,
        federation="lab",
        rounds=3,
        reply=lambda d, m: replies.append(m),
        max_samples=max_samples,
    )


def _register(book: DeviceBook, counts: dict[int, int]) -> None:
    per_class = tuple(counts.get(k, 0) for k in range(PRESET.classes))
    book.on_register(
        Register.for_client(
            federation="lab", device_id="cam", host="cam", instance="inst", preset=PRESET,
            budget_macs=CACHE.smallest.macs, samples=sum(per_class), profile={}, class_counts=per_class,
        )
    )  # fmt: skip


def test_the_server_takes_the_new_counts_of_an_accepted_device_within_max_samples(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry(tmp_path / "devices.sqlite")
    replies: list[Registered] = []
    book = _book(registry, replies)
    _register(book, {8: 30})
    assert replies[-1].accepted and registry.get("cam").samples == 30
    assert any("no registered device holds classes" in line and "Coat" in line for line in book.coverage.lines())
    with caplog.at_level(logging.WARNING, logger="feast_edge.server.devices"):
        for extra in (5, 10, 20, 30, 40):  # five growths from the same agent instance
            _register(book, {8: 30, 4: extra})
            assert replies[-1].accepted, replies[-1].reason
    assert registry.get("cam").samples == 70 and registry.get("cam").profile["class_counts"][4] == 40
    assert "never receives" not in caplog.text  # an agent registering new counts heard the answers
    lines = book.coverage.lines()  # the coverage the server warns of is the updated registration's
    assert not any("Coat" in line and "no registered device" in line for line in lines)
    _register(book, {8: 70, 4: 31})  # 101 > --max-samples 100: refused, the record it had stays
    assert not replies[-1].accepted and "--max-samples allows at most 100" in replies[-1].reason
    assert registry.get("cam").samples == 70


@pytest.mark.broker  # a server thread and an in-process agent training four tiny rounds (about 3 s)
def test_an_image_added_between_rounds_is_trained_on_in_a_later_round(
    kit, tmp_path: Path, federation: str, caplog: pytest.LogCaptureFixture
) -> None:
    from slowagents import agents_running

    from feast_edge.agent.agent import Agent
    from feast_edge.server.app import ServerConfig
    from feast_edge.transport.broker import LinkConfig

    caplog.set_level(logging.INFO, logger="feast_edge")
    root = tmp_path / "cam"
    _write(root, ("Bag", "Coat"), 0, 20)
    config = ServerConfig.of(
        out=str(tmp_path / "server"), preset=str(FMNIST_TINY), rounds=4, federation=federation, per_round=1,
        min_clients=1, round_timeout=60.0, wait_timeout=60.0, batch_size=16, eval_every=100, calib_samples=8,
    )  # fmt: skip
    server = kit.ServerThread(config).start()
    (client,) = load_clients(root, "cam", task=TASK)
    agent = Agent(
        AgentConfig(
            host="cam", federation=federation, preset=str(FMNIST_TINY), budget_macs=CACHE.smallest.macs, rescan=0.05
        ),
        LinkConfig(broker=kit.LOCAL),
        [client],
    )
    run_round = agent.rounds.run

    def then_grow(hosted, incoming):  # type: ignore[no-untyped-def]
        done = run_round(hosted, incoming)
        if incoming.message.round == 0:  # after round 1, before round 2 is trained: new images arrive
            _write(root, ("Bag", "Coat"), 20, 6)
        return done

    agent.rounds.run = then_grow
    try:
        with agents_running([agent]):
            history = server.join(120)
        registered = server.server.devices.registry.get("cam").samples
    finally:
        server.close()
    before, after = client.samples, agent.clients["cam"].data.samples
    assert after > before and agent.clients["cam"].data.holdout + after == 52
    assert all(r.applied and not r.rejected for r in history), [r.rejected for r in history]
    samples = [r.samples for r in history]
    assert samples[0] == before and samples[-1] == after and set(samples) == {before, after}, samples
    assert registered == after  # the server's record of it: the new count
