"""Models as versions over a real Mosquitto, with real agents (in this process, so that a run can follow another):

* devices that run a better model (from an earlier run) refuse a worse version, with their paired figures in the
  server's registry, while a device that runs none installs it and then installs the next version after comparing;
  the canaries' regressions hold both versions back, each with its reason;
* ``feast-agent rollback`` goes back one version by hand and the server records it;
* a restarted server keeps every version and install record and numbers new versions after them;
* an agent that cannot refuse a version (no model-versions feature) still receives models, recorded as ungated;
* version reports that lie or were never asked for are dropped without touching the registry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from slowagents import agents_running

from feast_edge.agent import registration
from feast_edge.agent.agent import Agent, AgentConfig
from feast_edge.agent.local_data import load_clients
from feast_edge.protocol import Register, VersionReport
from feast_edge.server.app import FederationServer
from feast_edge.server.status import read_status
from feast_edge.sim.shards import read_shard, write_partition
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics
from feast_edge.versions.book import VersionBook
from simconfigs import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(900)]

CONFIG = tiny_config(clients=3, train_limit=1500, test_limit=50, probe_variants=3, seed=5)
NAMES = ("client-000", "client-001", "client-002")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("versions-partition")
    write_partition(CONFIG, out)
    return out


def _agent(shards: Path, name: str, federation: str, models: Path, **config: object) -> Agent:
    return Agent(
        AgentConfig(
            host=name,
            federation=federation,
            preset=CONFIG.preset,
            threads=1,
            amp="off",
            budget_macs=read_shard(shards / f"{name}.safetensors").budget_macs,
            model_dir=str(models / name),
            personalize="off",
            stay=True,
            **config,
        ),
        LinkConfig(broker="127.0.0.1:1883"),
        load_clients(shards / f"{name}.safetensors", name, holdout=0.3),
    )


class Run:
    """A FederationServer in a thread, as ``feast-server run`` drives it: rounds, the final export and push."""

    def __init__(self, kit, shards: Path, out: Path, federation: str, **changes: object) -> None:
        settings = dict(data=None, per_round=3, min_clients=2, start_clients=3, round_timeout=120, serve_average=1)
        config = kit.server_config(CONFIG, out, shards, federation, **{**settings, **changes})
        self.server = FederationServer(config, LinkConfig(broker=kit.LOCAL))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.server.run()
            manifests = self.server.export()
            sent = self.server.announce_models(manifests)
            self.server.await_device_models(manifests, sent, timeout=120)
            self.server.finish(manifests)
            self.server.serve(2.0)
        except BaseException as exc:  # noqa: BLE001 - raised by join()
            self.error = exc

    def start(self) -> Run:
        self.server.start(timeout=5)
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the run did not end within {timeout} s"
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.server.stop.set()
        self.thread.join(30)
        self.server.close()


def _book(out: Path) -> VersionBook:
    return VersionBook(out / "versions.sqlite", readonly=True)


def _answered(out: Path, version: int, devices: set[str]) -> bool:
    if not (out / "versions.sqlite").is_file():
        return False
    book = _book(out)
    try:
        return devices <= set(book.answers(version))
    finally:
        book.close()


def _feast_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "feast_edge.agent.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_devices_refuse_a_worse_version_install_elsewhere_canaries_hold_it_rollback_and_a_restart_keep_the_record(
    kit, shards: Path, federation: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="feast_edge")
    models = tmp_path / "models"
    strong, fresh = NAMES[:2], NAMES[2]
    agents = [_agent(shards, name, federation, models) for name in NAMES]
    held = {a.config.host: a.clients[a.config.host].data.holdout for a in agents}
    with agents_running(agents):
        # An earlier run trains a good model; its two devices install it (the first model they run).
        first = Run(kit, shards, tmp_path / "first", federation, rounds=4, eval_every=2, lr=0.05).start()
        try:
            first.join(600)
        finally:
            first.close()
        book = _book(tmp_path / "first")
        assert {d: e.event for d, e in book.answers(book.latest().number).items()} == dict.fromkeys(NAMES, "first")
        book.close()
        # The third device forgets its model: it runs none when the next federation starts.
        for path in (models / fresh).iterdir():
            if path.is_file():
                path.unlink()
            else:
                shutil.rmtree(path)
        # A new federation without an end whose learning rate barely moves the weights: each of its versions is far
        # worse than the model the first two devices run, and every device is a canary.
        out = tmp_path / "second"
        second = Run(kit, shards, out, federation, continuous=True, eval_every=1, lr=1e-6, canary=1.0).start()
        try:
            assert kit.wait_for(lambda: _answered(out, 2, set(NAMES)) or not second.thread.is_alive(), 600)
            book = _book(out)
            one, two = book.version(1), book.version(2)
            answers = {v: book.answers(v) for v in (1, 2)}
            book.close()
            for device in strong:  # refused both, with the paired figures: far below what it runs
                for v in (1, 2):
                    event = answers[v][device]
                    assert event.event == "refused", (device, v, event)
                    verdict = event.verdict()  # recomputed by the server from the counts the device sent
                    assert verdict.examples == held[device]  # its whole held-out split, paired
                    assert verdict.old_accuracy - verdict.new_accuracy > verdict.threshold
            assert answers[1][fresh].event == "first"  # it ran nothing: installed the first at once
            installed = answers[2][fresh]  # and compared the next with it: within noise, installed
            assert installed.event == "installed" and installed.verdict().examples == held[fresh]
            for version in (one, two):
                assert sorted(version.canaries) == sorted(NAMES)
            # Held back, each with the canaries' figures as the reason (the devices that compared regressed).
            assert kit.wait_for(lambda: _book(out).version(2).state != "canary", 120)
            book = _book(out)
            for v in (1, 2):
                state = book.version(v)
                assert state.state == "held", state
                assert state.state_reason.startswith("held back: it regressed on 2 of 3 canaries") or (
                    state.state_reason.startswith("held back: it regressed on 2 of 2 canaries")
                ), state.state_reason
            book.close()
            # feast-agent rollback: the fresh device goes back one version by hand, and the server records it.
            book = _book(out)
            was = book.running()[fresh].version
            installs = [e.version for e in book.events(device=fresh) if e.event in ("first", "installed")]
            book.close()
            rolled = _feast_agent(
                "rollback", "--model-dir", str(models / fresh), "--device-id", fresh, "--broker", kit.LOCAL,
                "--federation", federation,
            )  # fmt: skip
            assert rolled.returncode == 0, rolled.stdout + rolled.stderr
            assert kit.wait_for(lambda: any(e.event == "rolled-back" for e in _book(out).events(device=fresh)), 60), (
                caplog.text[-3000:]
            )
            back = next(e for e in _book(out).events(device=fresh) if e.event == "rolled-back")
            assert back.version >= was and back.running in installs and back.running < back.version
            status = read_status(out)
            running = {d["device"]: d["version"] for d in status["devices"]}
            if not any(e.event != "offered" and e.version > back.version for e in _book(out).events(device=fresh)):
                assert running[fresh]["version"] == back.running  # no newer version reached it since
            assert all(running[d] is None for d in strong)  # they run the first federation's model
            assert status["versions"]["refusals"] >= 4 and status["versions"]["rollbacks"] == 1
            before = {v.number: v for v in _book(out).versions()}
            events = len(_book(out).events())
            second.server.request_stop()
            second.join(300)
        finally:
            second.close()
        # A restarted server loses no version or install record and numbers its next versions after them.
        again = Run(kit, shards, out, federation, continuous=True, eval_every=1, lr=1e-6, canary=1.0).start()
        try:
            assert kit.wait_for(lambda: max(v.number for v in _book(out).versions()) > max(before), 600)
            book = _book(out)
            after = {v.number: v for v in book.versions()}
            assert all(after[n].round == before[n].round and after[n].canaries == before[n].canaries for n in before)
            assert len(book.events()) >= events
            assert any(e.event == "rolled-back" for e in book.events(device=fresh))
            book.close()
            again.server.request_stop()
            again.join(300)
        finally:
            again.close()
    assert "held back: it regressed on" in caplog.text


def test_an_agent_that_cannot_refuse_a_version_still_gets_it_and_reports_nobody_asked_for_are_dropped(
    kit,
    shards: Path,
    federation: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="feast_edge")
    old = NAMES[2]  # registers without a feature list, as an agent from before versions

    class Older(Register):
        @classmethod
        def for_client(cls, **fields):
            message = Register.for_client(**fields)
            return dataclasses.replace(message, features=()) if message.device == old else message

    monkeypatch.setattr(registration, "Register", Older)
    models = tmp_path / "models"
    agents = [_agent(shards, name, federation, models) for name in NAMES]
    out = tmp_path / "run"
    attacker = Link(LinkConfig(broker=kit.LOCAL))
    attacker.connect(timeout=5)
    topics = Topics(federation)
    with agents_running(agents):
        run = Run(kit, shards, out, federation, continuous=True, eval_every=1, lr=0.05, canary=1.0).start()
        try:
            assert kit.wait_for(lambda: _answered(out, 1, set(NAMES)) or not run.thread.is_alive(), 600)
            book = _book(out)
            one = book.version(1)
            assert old not in one.canaries and sorted(one.canaries) == sorted(NAMES[:2])  # it cannot compare
            assert book.answers(1)[old].event == "ungated"
            assert book.running()[old].version == 1
            before = [e.to_dict() for e in book.events()]
            book.close()
            assert kit.wait_for(lambda: any((models / old).glob("*.onnx")), 120)  # it received and kept its model
            assert f"{old}'s agent cannot refuse a version (it does not list the model-versions feature)" in caplog.text

            def lie(device: str, **fields: object) -> None:
                report = VersionReport(federation=federation, round=0, device=device, **fields)  # type: ignore[arg-type]
                attacker.publish(topics.events(device), report.encode())

            lie("stranger", version=1, decision="installed", examples=10, new_correct=10, new_only=10)
            lie(NAMES[0], version=99, decision="refused", examples=10, old_correct=10, old_only=10)
            lie(NAMES[0], version=1, decision="rolled-back", running=42)  # it never ran version 42
            lie(NAMES[1], version=1, decision="ungated")  # an agent that reports cannot be ungated
            # Counts that do not add up never get past parsing.
            attacker.publish(
                topics.events(NAMES[1]),
                json.dumps(
                    {"v": 1, "kind": "version_report", "federation": federation, "round": 0, "device": NAMES[1],
                     "msg_id": "forged", "version": 1, "decision": "refused", "examples": 10, "new_correct": 5,
                     "old_correct": 9, "new_only": 0, "old_only": 0}
                ).encode(),
            )  # fmt: skip
            assert kit.wait_for(lambda: caplog.text.count("version_report from") >= 4, 30), caplog.text[-3000:]
            time.sleep(1.0)
            book = _book(out)
            assert [e.to_dict() for e in book.events()][: len(before)] == before
            assert not [e for e in book.events()[len(before) :] if e.device == "stranger" or e.version in (42, 99)]
            book.close()
            for why in ("not a registered device", "no version 99 was served", "it never ran version 1 (or the "
                        "version 42 it went back to)", "an agent that reports cannot be ungated",
                        "its agent registered without the model-versions feature"):  # fmt: skip
                assert why in caplog.text, why
            assert run.thread.is_alive()  # nothing stopped the server
            run.server.request_stop()
            run.join(300)
        finally:
            attacker.close()
            run.close()
