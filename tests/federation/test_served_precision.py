"""Served precision: each device gets its model in the precision it registered (or the server's --precision), int8
quantized where the data lives — the server's calibration split, or the device's own training data — and float32
when the int8 file is refused, with the reason in the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.on_device import OnDeviceError, calibrate_served_variant
from feast_edge.cache.variants import load_cache
from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate import quantize
from feast_edge.evaluate.onnx_export import read_metadata
from feast_edge.evaluate.quantize import QuantizationError
from feast_edge.server.export import Int8Settings, export_device_models, export_device_variants
from feast_edge.server.held_data import ServerData
from feast_edge.server.registry import Device
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

WHERE = {"federation": "fed", "rounds_done": 1, "checkpoint": "checkpoint.safetensors"}
OPEN = 1.0  # an untrained supernet is near chance in either precision: these tests are about what is served where


@pytest.fixture(scope="module")
def preset():
    return load_preset("fmnist-small")


@pytest.fixture(scope="module")
def supernet(preset):
    return Supernet(preset, seed=0)


@pytest.fixture(scope="module")
def test_split(fashion_mnist_dir: Path):
    return load_fashion_mnist(fashion_mnist_dir, "test")


def _device(device_id: str, budget: int, precision: str) -> Device:
    return Device(device_id, "host", "i" * 16, budget, 100, "fmnist-small", {}, 0.0, 0.0, "online", precision=precision)


def _fleet(preset) -> list[Device]:
    smallest = int(load_cache(preset).entries[0].macs)
    return [_device("pi", smallest, "int8"), _device("laptop", smallest, "fp32")]


def _server_data(split) -> ServerData:
    return ServerData(split.images[:200], split.labels[:200], split.images[200:300], None, "Fashion-MNIST test")


def _serve(supernet, preset, split, out: Path, int8: Int8Settings) -> list[dict]:
    """The server-held-data export of :func:`_fleet` into ``out``."""
    return export_device_models(
        supernet, load_cache(preset), _fleet(preset), _server_data(split), out, int8=int8, **WHERE
    )


def test_server_data_serves_each_device_its_registered_precision(supernet, preset, test_split, tmp_path: Path) -> None:
    manifests = _serve(supernet, preset, test_split, tmp_path, Int8Settings("auto", 64, OPEN))
    by_device = {m["device"]: m for m in manifests}
    assert by_device["pi"]["precision"] == "int8" and by_device["laptop"]["precision"] == "fp32"
    pi = read_metadata(tmp_path / "models" / "pi.onnx")
    assert pi["precision"] == "int8" and pi["int8_calibration_samples"] == "64" and pi["int8_check_samples"] == "200"
    assert "the server's calibration split" in pi["int8_calibration_origin"]
    assert by_device["pi"]["int8_accuracy"] == pytest.approx(float(pi["int8_accuracy"]))
    assert read_metadata(tmp_path / "models" / "laptop.onnx")["precision"] == "fp32"
    assert "int8_accuracy" not in by_device["laptop"]


def test_the_servers_precision_overrides_the_devices(supernet, preset, test_split, tmp_path: Path) -> None:
    manifests = _serve(supernet, preset, test_split, tmp_path, Int8Settings("fp32"))
    assert {m["precision"] for m in manifests} == {"fp32"}
    assert read_metadata(tmp_path / "models" / "pi.onnx")["precision"] == "fp32"


def test_a_refused_int8_file_is_served_in_float32_with_the_reason(
    supernet, preset, test_split, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args, **kwargs):
        raise QuantizationError("the int8 model loses 3.00 points against float32")

    monkeypatch.setattr("feast_edge.server.export.quantize_int8", refuse)
    manifests = _serve(supernet, preset, test_split, tmp_path, Int8Settings("int8"))
    pi = next(m for m in manifests if m["device"] == "pi")
    assert pi["precision"] == "fp32" and pi["int8_refused"] == "the int8 model loses 3.00 points against float32"
    assert read_metadata(tmp_path / "models" / "pi.onnx")["precision"] == "fp32"
    assert not list((tmp_path / "models").glob(".variant-*"))  # no temporary file left behind


def _own_data(split, holdout: int) -> LocalClient:
    return LocalClient(
        "pi",
        split.images[:300],
        split.labels[:300].long(),
        None,
        None,
        None,
        "own images",
        holdout_images=split.images[300 : 300 + holdout],
        holdout_labels=split.labels[300 : 300 + holdout].long(),
    )


def _weights(supernet, preset, tmp_path: Path, int8: Int8Settings) -> tuple[bytes, dict]:
    manifests = export_device_variants(
        supernet, load_cache(preset), _fleet(preset)[:1], tmp_path, calibration=100, int8=int8, **WHERE
    )
    return (tmp_path / "models" / manifests[0]["file"]).read_bytes(), manifests[0]


def test_without_server_data_the_device_quantizes_on_its_own_data(supernet, preset, test_split, tmp_path: Path) -> None:
    blob, manifest = _weights(supernet, preset, tmp_path, Int8Settings("auto", 48, OPEN))
    assert manifest["precision"] == "int8" and (manifest["int8_samples"], manifest["int8_tolerance"]) == (48, OPEN)
    path, metrics = calibrate_served_variant(blob, manifest, _own_data(test_split, 60), preset, tmp_path / "pi.onnx")
    meta = read_metadata(path)
    assert (
        meta["precision"] == "int8" and meta["int8_calibration_samples"] == "48" and meta["int8_check_samples"] == "60"
    )
    assert meta["int8_calibration_origin"] == "device pi's training data"
    saved = json.loads(path.with_suffix(".json").read_text())
    assert saved["precision"] == "int8" and saved["int8_accuracy"] == pytest.approx(float(meta["int8_accuracy"]))
    assert metrics["model_precision"] == "int8" and metrics["int8_accuracy"] == saved["int8_accuracy"]


def test_a_device_that_cannot_check_int8_keeps_float32(supernet, preset, test_split, tmp_path: Path) -> None:
    blob, manifest = _weights(supernet, preset, tmp_path, Int8Settings("int8", 48, OPEN))
    path, metrics = calibrate_served_variant(blob, manifest, _own_data(test_split, 10), preset, tmp_path / "pi.onnx")
    assert read_metadata(path)["precision"] == "fp32"
    assert metrics["model_precision"] == "fp32"
    assert "10 held-out images cannot check an int8 file" in metrics["int8_refused"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("precision", "fp8", "asks for precision 'fp8'; known: fp32, int8"),
        ("int8_samples", 10**9, "int8_samples must be an integer in"),
        ("int8_samples", True, "int8_samples must be an integer in"),
        ("int8_tolerance", -1, "int8_tolerance must be a number in [0, 1]"),
        ("int8_tolerance", "1", "int8_tolerance must be a number in [0, 1]"),
    ],
)
def test_a_manifest_asking_the_impossible_is_refused_before_anything_is_written(
    supernet, preset, test_split, tmp_path: Path, field: str, value, message: str
) -> None:
    blob, manifest = _weights(supernet, preset, tmp_path, Int8Settings("int8", 48, OPEN))
    with pytest.raises(OnDeviceError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        calibrate_served_variant(
            blob, {**manifest, field: value}, _own_data(test_split, 60), preset, tmp_path / "pi.onnx"
        )
    assert not (tmp_path / "pi.onnx").exists()


def test_a_variant_of_another_preset_names_the_preset_to_pass(supernet, preset, test_split, tmp_path: Path) -> None:
    """A model exported for another preset than the one the device loaded is refused with the preset to pass (not as
    weights that fail to fit), before anything is written."""
    blob, manifest = _weights(supernet, preset, tmp_path, Int8Settings("fp32"))
    other = {**manifest, "preset": "my-task", "preset_digest": "0" * 64}
    with pytest.raises(OnDeviceError, match="a variant of preset 'my-task', this device loaded preset 'fmnist-small'"):
        calibrate_served_variant(blob, other, _own_data(test_split, 60), preset, tmp_path / "pi.onnx")
    assert not (tmp_path / "pi.onnx").exists()


def test_the_quantizer_is_not_reached_for_float32(supernet, preset, test_split, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(quantize, "quantize_int8", lambda *a, **k: pytest.fail("float32 was asked"))
    blob, manifest = _weights(supernet, preset, tmp_path, Int8Settings("fp32"))
    assert manifest["precision"] == "fp32" and "int8_samples" not in manifest
    path, metrics = calibrate_served_variant(blob, manifest, _own_data(test_split, 60), preset, tmp_path / "pi.onnx")
    assert read_metadata(path)["precision"] == "fp32" and metrics["model_precision"] == "fp32"
    assert torch.is_tensor(test_split.images)


@pytest.mark.parametrize(
    ("manifest", "metrics", "shown"),
    [
        ({"precision": "int8"}, None, "int8"),  # exported on the server: the manifest is what was kept
        ({"precision": "fp32", "int8_refused": "loses 3 points"}, None, "fp32 (int8 refused)"),
        ({}, None, "fp32"),  # a manifest from before precisions
        ({"calibration": "device", "precision": "int8", "rounds": 3}, {}, "int8 asked"),
        (
            {"calibration": "federated", "precision": "int8", "rounds": 3},
            {"model_precision": "int8", "model_round": 2},
            "int8 asked",
        ),
        (
            {"calibration": "device", "precision": "int8", "rounds": 3},
            {"model_precision": "int8", "model_round": 3},
            "int8",
        ),
        (
            {"calibration": "device", "precision": "int8", "rounds": 3},
            {"model_precision": "fp32", "model_round": 3, "int8_refused": "20 held-out images needed"},
            "fp32 (int8 refused)",
        ),
    ],
)
def test_the_served_precision_is_what_was_kept(manifest: dict, metrics, shown: str) -> None:
    from feast_edge.report.model_words import served_precision

    assert served_precision(manifest, metrics) == shown


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--precision", "fp8"], "--precision 'fp8' must be one of auto, fp32, int8 (auto: each device's profile)"),
        (["--int8-tolerance", "2"], "--int8-tolerance 2 must be a fraction in [0, 1] (0.01 = 1 point)"),
    ],
)
def test_the_servers_precision_options_are_checked_first(
    server_cli, tmp_path: Path, args: list[str], fragment: str
) -> None:
    nowhere = "mqtt://127.0.0.1:9"  # never reached: the options are refused before any connection
    result = server_cli.invoke("run", "--insecure", "--broker", nowhere, "--out", str(tmp_path / "run"), *args)
    server_cli.assert_user_error(result, fragment)
    assert result.returncode == 2 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("named", ["/etc/passwd.toml", "../presets/x", "my-task.toml", "", None, 7, "a" * 65])
def test_a_model_manifest_names_its_preset_by_name_never_by_path(named) -> None:
    """fetch-model without --preset loads the preset the server's manifest names: a name, never a file it would open."""
    from feast_edge.agent.model_files import ModelError, _manifest_preset

    with pytest.raises(ModelError, match="names no valid preset; pass --preset"):
        _manifest_preset({"preset": named})
    assert _manifest_preset({"preset": "fmnist-small"}).name == "fmnist-small"
