"""A device checks the model it is sent (issue 35, item 3): BN statistics of the federation that make its model much
worse on its own held-out split than its own recalibration are not kept silently. The device keeps its own, says why
in one line, and the line reaches the server's table."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
from rich.console import Console
from safetensors.torch import save
from tinymodels import trained_smallest

from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.on_device import calibrate_served_variant
from feast_edge.cache.variants import load_cache
from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate.bn_stats import Stats, apply_statistics, bn_statistics
from feast_edge.evaluate.onnx_export import read_metadata
from feast_edge.personalize.select import Choice
from feast_edge.server.output import device_models_table
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.static import StaticResNet
from strategies import FMNIST_TINY

PRESET = load_preset(str(FMNIST_TINY))
ARCH = load_cache(PRESET).entries[0].arch


@pytest.fixture(scope="module")
def trained(fashion_mnist_dir: Path) -> tuple[StaticResNet, LocalClient]:
    """fmnist-tiny's smallest variant trained two epochs on 1,200 real images, and a device's own data."""
    split = load_fashion_mnist(fashion_mnist_dir, "train")
    model = trained_smallest(split)
    own = LocalClient(
        "pi",
        split.images[2000:2400],
        split.labels[2000:2400].long(),
        None,
        None,
        None,
        "own images",
        holdout_images=split.images[2400:2600],
        holdout_labels=split.labels[2400:2600].long(),
    )
    return model, own


def _served(model: StaticResNet, stats: Stats) -> tuple[bytes, dict]:
    """The variant's weights with ``stats`` in its BN buffers, as the server sends a federated-BN variant."""
    served = StaticResNet(arch_layout(PRESET, ARCH))
    served.load_state_dict(model.state_dict())
    apply_statistics(served, stats)
    blob = save({k: v.contiguous() for k, v in served.state_dict().items()})
    manifest = {
        "device": "pi",
        "arch": ARCH.to_dict(),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "preset": PRESET.name,
        "preset_digest": PRESET.digest,
        "calibration": "federated",
        "calibration_samples": 200,
        "rounds": 3,
        "macs": load_cache(PRESET).entries[0].macs,
    }
    return blob, manifest


def test_statistics_that_ruin_the_model_on_the_devices_data_are_replaced_by_its_own(trained, tmp_path: Path) -> None:
    model, own = trained
    honest = bn_statistics(model, own.images[:200], PRESET)
    shifted = {n: (m + 3 * v.sqrt(), v * 0.25) for n, (m, v) in honest.items()}  # issue 35's plausible lie
    path, metrics = calibrate_served_variant(*_served(model, shifted), own, PRESET, tmp_path / "pi.onnx")
    assert "kept its own" in metrics["bn_refused"] and "\n" not in metrics["bn_refused"]
    assert read_metadata(path)["bn_calibration"] == "device"  # the file says whose statistics it holds
    assert json.loads(path.with_suffix(".json").read_text())["bn_calibration"] == "device"
    kept = metrics["holdout_accuracy"]
    assert kept > 0.5  # its own recalibration of a trained model, not the ruined one
    # The line reaches the server's table of served models.
    table = device_models_table([{"device": "pi", "macs": 1e6, "calibration": "federated"}], {"pi": metrics}, "models")
    console = Console(width=200, record=True)
    console.print(table)
    assert "refused the federated" in console.export_text()


def test_honest_statistics_are_kept(trained, tmp_path: Path) -> None:
    model, own = trained
    honest = bn_statistics(model, own.images[:200], PRESET)
    path, metrics = calibrate_served_variant(*_served(model, honest), own, PRESET, tmp_path / "pi.onnx")
    assert "bn_refused" not in metrics and read_metadata(path)["bn_calibration"] == "federated"
    assert metrics["holdout_accuracy"] > 0.5


def test_the_device_says_what_it_does_before_the_long_steps(trained, tmp_path: Path, caplog) -> None:
    """Issue 37: calibrating, exporting, timing and personalizing took 25-46 s without a line."""
    model, own = trained
    honest = bn_statistics(model, own.images[:200], PRESET)
    with caplog.at_level(logging.INFO, logger="feast_edge.agent"):
        calibrate_served_variant(
            *_served(model, honest), own, PRESET, tmp_path / "pi.onnx", personalize=Choice.parse("auto")
        )
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("feast_edge.agent")]
    order = [
        next(i for i, line in enumerate(lines) if line.startswith(start))
        for start in (
            "pi: preparing the served model",
            "exported the model of pi",
            "pi: personalizing the served model",
        )
    ]
    assert order == sorted(order), lines
    macs = f"{load_cache(PRESET).entries[0].macs:,}"
    assert (
        f"({macs} MACs): checking the federation's BN statistics on its data, exporting it to ONNX" in lines[order[0]]
    )
    assert lines[order[2]].endswith("(--personalize auto)") and len(lines) > order[2] + 1  # its outcome follows


@pytest.mark.broker
def test_the_server_stops_awaiting_a_device_that_went_offline(
    kit, tmp_path: Path, federation: str, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: one silent device added a whole --round-timeout to the end of every run while the server waited for
    its calibrated-model report. A device that disconnected is no longer awaited (after a few seconds' grace)."""
    import logging
    import threading
    import time

    from test_federation_failures import ScriptedDevice

    from feast_edge.server import app
    from feast_edge.server.app import FederationServer
    from feast_edge.server.config import ServerConfig
    from feast_edge.transport.broker import LinkConfig

    caplog.set_level(logging.INFO, logger="feast_edge")
    monkeypatch.setattr(app, "OFFLINE_GRACE", 0.5)  # the grace a report in flight gets (5 s) is not what is tested
    server = FederationServer(
        ServerConfig.of(out=str(tmp_path / "run"), rounds=1, federation=federation, per_round=1, min_clients=1),
        LinkConfig(broker=kit.LOCAL),
    )
    server.start(timeout=5)
    device = ScriptedDevice(federation, "gone")
    try:
        answer: dict = {}
        registering = threading.Thread(target=lambda: answer.update(registered=device.register()))
        registering.start()
        while registering.is_alive():  # the server handles messages as it pumps (its run loop's job)
            server.pump(0.1)
        assert answer["registered"].accepted and "gone" in server.online_devices()
        device.close()  # leaves: its presence goes offline
        began = time.monotonic()
        reports = server.await_device_models([{"device": "gone", "rounds": 1}], ["gone"], timeout=120)
        waited = time.monotonic() - began
    finally:
        server.close()
    assert reports == {} and waited < 20  # not the 120 s timeout
    assert "no calibrated-model report from gone" in caplog.text and "(gone went offline)" in caplog.text
