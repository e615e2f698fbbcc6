"""A pushed model as a version the device may refuse (feast_edge.agent.install_gate), end to end on real files: a
device whose own images are PNG files on disk, real variant weights calibrated and exported to ONNX on it, both models
run in onnxruntime on its held-out split, the paired decision, the files in place, the version_report and the metrics.

The served weights: fmnist-tiny's smallest variant trained on 1,200 Fashion-MNIST images (tests/tinymodels.py), and
the same weights with the classifier's rows rotated by one class (every prediction moves to the next class: clearly
worse, a model that must be refused).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from imagefolders import write_image_folder
from safetensors.torch import save
from tinymodels import ARCH, PRESET, trained_smallest

from feast_edge.agent.held_versions import UNVERSIONED
from feast_edge.agent.install_gate import receive_version
from feast_edge.agent.local_data import LocalClient, load_clients
from feast_edge.agent.on_device import calibrate_served_variant
from feast_edge.agent.version_store import VersionStore
from feast_edge.cache.variants import load_cache
from feast_edge.data.holdout import content_draws
from feast_edge.data.images import FASHION_MNIST_CLASSES, load_fashion_mnist
from feast_edge.evaluate.onnx_export import export_onnx
from feast_edge.evaluate.predict import evaluate, load_model
from feast_edge.personalize.select import Choice
from feast_edge.protocol import Metrics, ModelReady, VersionReport
from feast_edge.space.arch import Arch
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.static import StaticResNet
from feast_edge.transport.frames import describe
from feast_edge.transport.messages import parse
from feast_edge.versions.gate import FIRST, INSTALLED, REFUSED, from_counts
from strategies import TINY_PRESET

DEVICE, FED = "jetson", "lab"
MACS = load_cache(PRESET).entries[0].macs


@dataclass(frozen=True)
class Lab:
    good: dict[str, torch.Tensor]
    bad: dict[str, torch.Tensor]
    device: LocalClient  # its own images: held out 0.3, a test split of 0.2, the rest to train on
    images: Path


@pytest.fixture(scope="module")
def lab(fashion_mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Lab:
    split = load_fashion_mnist(fashion_mnist_dir, "test")
    good = trained_smallest(split).eval().state_dict()
    bad = dict(good)
    rotated = torch.roll(torch.arange(len(FASHION_MNIST_CLASSES)), 1)
    bad["classifier.weight"], bad["classifier.bias"] = (
        good["classifier.weight"][rotated],
        good["classifier.bias"][rotated],
    )
    images = tmp_path_factory.mktemp("own") / "images"
    write_image_folder(images, dict.fromkeys(range(10), 40), "png-grey", split, FASHION_MNIST_CLASSES, offset=200)
    device = load_clients(images, DEVICE, task=PRESET.task, holdout=0.3, test_split=0.2)[0]
    return Lab(good, bad, device, images)


def _weights(state: dict[str, torch.Tensor], version: int | None, **manifest: object) -> tuple[bytes, ModelReady]:
    """The variant's weights as a server without data pushes them (for the device to calibrate and export)."""
    blob = save({k: v.contiguous() for k, v in state.items()})
    fields = {
        "format": "feast-edge/device-model",
        "version": 1,  # the manifest format's: never the served version
        "device": DEVICE,
        "federation": FED,
        "arch": ARCH.to_dict(),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "preset": PRESET.name,
        "preset_digest": PRESET.digest,
        "calibration": "device",
        "calibration_samples": 200,
        "rounds": 3 + (version or 0),
        "served_round": {"round": 2 + (version or 0), "of": 3 + (version or 0)},
        "macs": MACS,
        **({"model_version": version} if version is not None else {}),
        **manifest,
    }
    return blob, _message(blob, fields)


def _onnx(state: dict[str, torch.Tensor], version: int, folder: Path) -> tuple[bytes, ModelReady]:
    """The same weights exported to ONNX by a server that holds data (the device keeps the file as it is)."""
    model = StaticResNet(arch_layout(PRESET, ARCH))
    model.load_state_dict(state)
    path = folder / f"server-{version}.onnx"
    export_onnx(model.eval(), path, PRESET, ARCH, class_names=PRESET.task.classes)
    blob = path.read_bytes()
    fields = {"device": DEVICE, "federation": FED, "sha256": hashlib.sha256(blob).hexdigest(), "macs": MACS}
    return blob, _message(blob, {**fields, "rounds": 5, "model_version": version, "validation_accuracy": 0.5})


def _message(blob: bytes, manifest: dict) -> ModelReady:
    transfer = describe(blob, federation=FED, round=0, device=DEVICE).to_dict()
    return ModelReady(federation=FED, round=0, device=DEVICE, transfer=transfer, manifest=manifest)


def _receive(blob: bytes, message: ModelReady, model_dir: Path, device: LocalClient, **options):
    return receive_version(blob, message, model_dir, data=device, preset=PRESET, federation=FED, **options)


def _correct(path: Path, images: torch.Tensor, labels: torch.Tensor) -> int:
    return evaluate(load_model(path), images, labels).correct


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_clearly_worse_version_is_refused_and_the_device_keeps_the_model_it_runs(lab: Lab, tmp_path, caplog) -> None:
    device, served = lab.device, tmp_path / f"{DEVICE}.onnx"
    first = _receive(*_weights(lab.good, 1), tmp_path, device)
    assert first.record.decision == FIRST and first.running == 1 and served.is_file()
    report = first.report(FED, 0, DEVICE)
    running = _correct(served, device.holdout_images, device.holdout_labels)
    # Nothing to compare with: the report carries the version's own held-out counts (what the device runs from now).
    assert (report.decision, report.version, report.running, report.examples) == (FIRST, 1, 1, device.holdout)
    assert (report.new_correct, report.new_only, report.old_correct, report.old_only) == (running, running, 0, 0)
    assert first.metrics["model_version"] == 1 and first.metrics["model_round"] == 4
    assert first.record.holdout_accuracy == pytest.approx(running / device.holdout)
    kept = _sha(served)

    with caplog.at_level(logging.INFO, logger="feast_edge.agent.install_gate"):
        refused = _receive(*_weights(lab.bad, 2), tmp_path, device)
    assert refused.record.decision == REFUSED and _sha(served) == kept  # the model in place did not change
    assert refused.running == 1 and refused.served == served
    line = next(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert (
        line.startswith(f"{DEVICE} refused version 2 (round 4, seq 0002): refused: ") and "it keeps version 1" in line
    )

    # The figures: the running model's count measured here again, the candidate's by preparing the same weights
    # apart (calibration is seeded: the same ONNX file) and running them.
    blob, message = _weights(lab.bad, 2)
    (tmp_path / "apart").mkdir()
    apart = calibrate_served_variant(blob, message.manifest, device, PRESET, tmp_path / "apart" / "bad.onnx")[0]
    candidate = _correct(apart, device.holdout_images, device.holdout_labels)
    sent = parse(refused.report(FED, 0, DEVICE).encode())
    assert isinstance(sent, VersionReport)
    assert (sent.version, sent.decision, sent.running, sent.examples) == (2, REFUSED, 1, device.holdout)
    assert (sent.old_correct, sent.new_correct) == (running, candidate) and candidate < running / 2
    assert sent.new_only - sent.old_only == candidate - running
    assert not from_counts(sent.examples, sent.new_correct, sent.old_correct, sent.new_only, sent.old_only).install
    assert sent.reason == ""  # the figures say it all: the server words them itself (Verdict.words)
    metrics = parse(Metrics(federation=FED, round=0, device=DEVICE, values=refused.metrics).encode()).values
    assert metrics["model_kept"] is False and metrics["model_version"] == 2 and metrics["model_running_version"] == 1
    assert metrics["model_refused"] == refused.verdict.words()

    # Its record stays, its files do not; the test split was measured on both, and decided nothing.
    held = VersionStore(tmp_path, DEVICE).read()
    assert held.current == 1 and held.record(2).files == {} and not (held.record(2).test_accuracy is None)
    assert held.record(2).holdout_accuracy == pytest.approx(candidate / device.holdout)
    test = _correct(served, device.test_images, device.test_labels)
    assert held.record(1).test_accuracy == pytest.approx(test / device.test_samples)
    assert first.metrics["test_accuracy"] == pytest.approx(test / device.test_samples)


def test_the_test_split_is_apart_from_training_and_the_held_out_split_and_never_decides(lab: Lab, tmp_path) -> None:
    device = lab.device
    draws = {name: content_draws(getattr(device, f"{name}_images"), getattr(device, f"{name}_labels"))
             for name in ("holdout", "test")}  # fmt: skip
    train = content_draws(device.images, device.labels)
    assert (draws["holdout"] < 0.3).all() and ((draws["test"] >= 0.3) & (draws["test"] < 0.5)).all()
    assert (train >= 0.5).all() and device.test_samples > 20
    # Without a test split the held-out split is the same images as before, bit for bit.
    before = load_clients(lab.images, DEVICE, task=PRESET.task, holdout=0.3)[0]
    assert torch.equal(before.holdout_images, device.holdout_images) and before.test_samples == 0

    # A test split on which the bad model would look perfect changes nothing of the decision.
    _receive(*_weights(lab.good, 1), tmp_path, device)
    relabelled = replace(device, test_labels=(device.test_labels + 1) % 10)
    refused = _receive(*_weights(lab.bad, 2), tmp_path, relabelled)
    assert refused.record.decision == REFUSED and refused.record.test_accuracy > 0.5


def test_under_dp_the_server_hears_the_decision_alone_and_the_device_decides_on_its_figures_all_the_same(
    lab: Lab, tmp_path
) -> None:
    _receive(*_weights(lab.good, 1, version_report="decision"), tmp_path, lab.device)
    refused = _receive(*_weights(lab.bad, 2, version_report="decision"), tmp_path, lab.device)
    installed = _receive(*_weights(lab.good, 3, version_report="decision"), tmp_path, lab.device)
    for outcome, decision in ((refused, REFUSED), (installed, INSTALLED)):
        sent = parse(outcome.report(FED, 0, DEVICE).encode())
        assert sent.decision == decision and (sent.examples, sent.new_correct, sent.old_correct) == (0, 0, 0)
        assert "%" not in sent.reason and "figures withheld" in sent.reason
        assert outcome.record.figures["examples"] == lab.device.holdout  # decided on them, kept on the device
    assert "%" not in refused.metrics["model_refused"] and "test_accuracy" not in installed.metrics
    assert refused.record.test_accuracy is not None  # measured and recorded on the device, not sent


def test_a_manifest_without_model_version_is_installed_as_before_without_a_report(lab: Lab, tmp_path) -> None:
    _receive(*_weights(lab.good, 1), tmp_path, lab.device)
    older = _receive(*_weights(lab.bad, None), tmp_path, lab.device)  # an older server: no model_version
    assert older.record.decision == UNVERSIONED and older.verdict is None and older.report(FED, 0, DEVICE) is None
    assert "model_version" not in older.metrics and older.metrics["model_round"] == 3
    assert _sha(tmp_path / f"{DEVICE}.onnx") == older.record.files[f"{DEVICE}.onnx"]  # installed, as before


def test_a_device_without_a_held_out_split_installs_without_a_comparison_and_says_so(lab: Lab, tmp_path) -> None:
    device = load_clients(lab.images, DEVICE, task=PRESET.task, holdout=0.0)[0]
    _receive(*_weights(lab.good, 1), tmp_path, device)
    installed = _receive(*_weights(lab.bad, 2), tmp_path, device)
    report = installed.report(FED, 0, DEVICE)
    assert (report.decision, report.examples, report.running) == (INSTALLED, 0, 2)
    assert "not compared" in report.reason and "held-out split" in report.reason


def test_a_server_exported_onnx_file_passes_the_same_gate(lab: Lab, tmp_path) -> None:
    server = tmp_path / "server"
    server.mkdir()
    models = tmp_path / "models"
    first = _receive(*_onnx(lab.good, 1, server), models, lab.device, personalize=Choice.parse("auto"))
    assert first.record.decision == FIRST and first.metrics["holdout_accuracy"] == first.record.holdout_accuracy
    assert first.metrics["personal_method"] == ""  # no weights to personalize, as before
    refused = _receive(*_onnx(lab.bad, 2, server), models, lab.device)
    assert refused.record.decision == REFUSED and refused.verdict.old_correct > 2 * refused.verdict.new_correct
    assert _sha(models / f"{DEVICE}.onnx") == _sha(server / "server-1.onnx")

    # A file of another task (1x16x16, 5 classes) cannot classify the device's images: refused, with the reason.
    other = load_preset(str(TINY_PRESET))
    arch = Arch.smallest(other)
    path = server / "other-task.onnx"
    export_onnx(StaticResNet(arch_layout(other, arch)).eval(), path, other, arch)
    blob = path.read_bytes()
    foreign = _receive(
        blob, _message(blob, {"sha256": _sha(path), "federation": FED, "model_version": 3}), models, lab.device
    )
    assert foreign.record.decision == REFUSED and foreign.running == 1
    assert "cannot run on this device's held-out examples" in foreign.report(FED, 0, DEVICE).reason
    assert _sha(models / f"{DEVICE}.onnx") == _sha(server / "server-1.onnx")


def test_the_personal_model_is_made_for_each_version_and_installed_with_it(lab: Lab, tmp_path) -> None:
    personal = Choice.parse("prior:1")
    _receive(*_weights(lab.good, 1), tmp_path, lab.device, personalize=personal)
    about = json.loads((tmp_path / f"{DEVICE}.personal.json").read_text())
    assert about["served_sha256"] == _sha(tmp_path / f"{DEVICE}.onnx")
    assert about["sha256"] == _sha(tmp_path / f"{DEVICE}.personal.onnx")
    refused = _receive(*_weights(lab.bad, 2), tmp_path, lab.device, personalize=personal)
    assert refused.record.decision == REFUSED
    assert json.loads((tmp_path / f"{DEVICE}.personal.json").read_text()) == about  # the pair in place is untouched


def test_int8_files_pass_the_gate_as_they_are_served(lab: Lab, tmp_path) -> None:
    int8 = {"precision": "int8", "int8_samples": 100, "int8_tolerance": 0.05}
    first = _receive(*_weights(lab.good, 1, **int8), tmp_path, lab.device)
    assert first.metrics["model_precision"] == "int8"
    served = tmp_path / f"{DEVICE}.onnx"
    assert first.record.holdout_accuracy == pytest.approx(
        _correct(served, lab.device.holdout_images, lab.device.holdout_labels) / lab.device.holdout
    )
    refused = _receive(*_weights(lab.bad, 2, **int8), tmp_path, lab.device)
    assert refused.record.decision == REFUSED and _sha(served) == first.record.files[f"{DEVICE}.onnx"]


class _Downloads:
    """What the agent waits on for a pushed model's transfer: here the blob has arrived."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def wait(self, info, deadline, abandon=None) -> bytes:
        return self.blob


def test_a_running_agent_reports_each_version_and_compares_the_next_with_what_a_rollback_left(
    lab: Lab, tmp_path, federation: str, agent_cli
) -> None:
    """The agent's own path (its _receive_model, its link): version_report then metrics on its events topic; a
    feast-agent rollback beside it; the next version is compared with the model the rollback made current."""
    from feast_edge.agent.agent import Agent, AgentConfig
    from feast_edge.transport.broker import LinkConfig
    from feast_edge.transport.link import Link
    from feast_edge.transport.topics import Topics

    torch.manual_seed(7)  # version 1: the good weights blurred (weaker); version 2: the good ones (better: installed)
    weaker = {k: v + 0.3 * v.std() * torch.randn_like(v) if v.is_floating_point() and v.dim() > 1 else v
              for k, v in lab.good.items()}  # fmt: skip
    config = AgentConfig(
        host=DEVICE,
        federation=federation,
        preset=PRESET.name,
        budget_macs=1e9,
        model_dir=str(tmp_path),
        personalize="off",
    )
    broker = LinkConfig(broker="mqtt://127.0.0.1:1883")
    agent = Agent(config, broker, [lab.device])
    heard: list[object] = []
    server = Link(broker)
    server.subscribe(Topics(federation).events(DEVICE), lambda r: heard.append(parse(r.payload)))
    server.connect(timeout=5)
    agent.start(timeout=5)

    def push(state: dict[str, torch.Tensor], version: int) -> VersionReport:
        blob, message = _weights(state, version)
        message = replace(message, federation=federation, manifest={**message.manifest, "federation": federation})
        agent.clients[DEVICE].downloads = _Downloads(blob)  # type: ignore[assignment]
        count = len(heard)
        agent._receive_model(message)
        deadline = time.monotonic() + 10
        while len([m for m in heard[count:] if isinstance(m, Metrics)]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        kinds = [type(m).__name__ for m in heard[count:] if isinstance(m, (VersionReport, Metrics))]
        assert kinds == ["VersionReport", "Metrics"], kinds
        return next(m for m in heard[count:] if isinstance(m, VersionReport))

    try:
        assert push(weaker, 1).decision == FIRST
        served = tmp_path / f"{DEVICE}.onnx"
        ran_first = _correct(served, lab.device.holdout_images, lab.device.holdout_labels)
        second = push(lab.good, 2)
        assert second.decision == INSTALLED and second.old_correct == ran_first
        assert second.new_only + second.old_only > 0  # the two differ on some examples (else this proves little)

        count = len(heard)
        rolled = agent_cli.invoke(
            "rollback", "--model-dir", str(tmp_path), "--device-id", DEVICE, "--broker", "mqtt://127.0.0.1:1883",
            "--federation", federation,
        )  # fmt: skip
        assert rolled.returncode == 0, rolled.stderr
        deadline = time.monotonic() + 10
        while not [m for m in heard[count:] if isinstance(m, VersionReport)] and time.monotonic() < deadline:
            time.sleep(0.05)
        told = [m for m in heard[count:] if isinstance(m, VersionReport)]
        assert len(told) == 1 and (told[0].decision, told[0].version, told[0].running) == ("rolled-back", 2, 1)
        assert _correct(served, lab.device.holdout_images, lab.device.holdout_labels) == ran_first

        third = push(lab.good, 3)  # compared with version 1, which runs again, not with version 2 (its own weights)
        assert (third.old_correct, third.new_only, third.old_only) == (ran_first, second.new_only, second.old_only)
        assert third.running == 3
    finally:
        agent.close()
        server.close()
