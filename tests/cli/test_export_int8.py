"""``feast-edge export --precision int8``: the int8 file, its metadata, and each bad input as one ``error:`` line."""

from __future__ import annotations

from pathlib import Path

import pytest

from feast_edge.evaluate import quantize
from feast_edge.evaluate.onnx_export import read_metadata
from feast_edge.evaluate.quantize import QuantizationError

ARCH = '{"d":[1,0,1,0],"e":[0.5,0.5,0.5,0.5],"w":[2,2,2,2,2]}'


@pytest.fixture(scope="module")
def checkpoint(cli, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt-int8") / "init.safetensors"
    result = cli.invoke("init", "--preset", "fmnist-small", "--out", str(path), "--seed", "1")
    assert result.returncode == 0, result.stderr
    return path


def _export(cli, checkpoint: Path, out: Path, *extra: str):
    return cli.invoke(
        "export", "-k", str(checkpoint), "-a", ARCH, "-o", str(out), "--calibration-samples", "64", *extra
    )


def test_export_writes_an_int8_file(cli, checkpoint: Path, fashion_mnist_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.onnx"
    # An untrained model is near chance in either precision: the tolerance is opened so the test is about the file.
    result = _export(
        cli,
        checkpoint,
        out,
        "--calibration-data",
        str(fashion_mnist_dir),
        "--precision",
        "int8",
        "--int8-samples",
        "32",
        "--int8-check",
        "200",
        "--int8-tolerance",
        "1",
    )
    assert result.returncode == 0, result.stderr
    meta = read_metadata(out)
    assert meta["precision"] == "int8" and meta["int8_calibration_samples"] == "32"
    assert meta["int8_check_samples"] == "200" and meta["bn_recalibrated"] == "true"
    assert "Fashion-MNIST train split" in meta["int8_calibration_origin"]
    assert ", int8" in result.stdout and "int8: int8 " in result.stdout


def test_a_refused_int8_file_keeps_the_float32_one(
    cli, checkpoint: Path, fashion_mnist_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args, **kwargs):
        raise QuantizationError("the int8 model loses 4.00 points against float32 (...)")

    monkeypatch.setattr(quantize, "quantize_int8", refuse)
    out = tmp_path / "m.onnx"
    result = _export(cli, checkpoint, out, "--calibration-data", str(fashion_mnist_dir), "--precision", "int8")
    cli.assert_user_error(result, f"loses 4.00 points against float32 (...); kept the float32 model in {out}")
    assert result.returncode == 2
    assert read_metadata(out)["precision"] == "fp32"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--precision", "fp8"], "--precision 'fp8' is unknown; choose fp32 (float32) or int8"),
        (["--precision", "int8"], "--precision int8 calibrates on images: give --calibration-data"),
    ],
)
def test_bad_precision_input_is_one_line(cli, checkpoint: Path, tmp_path: Path, args: list[str], fragment: str) -> None:
    out = tmp_path / "m.onnx"
    result = _export(cli, checkpoint, out, *args)
    cli.assert_user_error(result, fragment)
    assert result.returncode == 2 and not out.exists()


def test_an_int8_tolerance_outside_zero_to_one_is_one_line(cli, checkpoint: Path, tmp_path: Path) -> None:
    result = _export(cli, checkpoint, tmp_path / "m.onnx", "--precision", "int8", "--int8-tolerance", "5")
    cli.assert_user_error(result, "--int8-tolerance 5 must be a fraction in [0, 1] (0.01 = 1 point)")
