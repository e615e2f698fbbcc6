"""The feast-edge command line, run as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import TINY_PRESET

JSON_ARCH = '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}'
SMALL_ARCH = '{"d":[1,0,1,0],"e":[0.5,0.5,0.5,0.5],"w":[2,2,2,2,2]}'


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "feast_edge.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
        timeout=300,
    )


def assert_user_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]


def test_arch_json_reports_spec_figures():
    result = run("arch", "--preset", "paper-cifar100", "--classes", "10", "--json", "--arch", JSON_ARCH)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["macs"], record["params"]) == (24957968, 327522)
    assert [s["blocks"] for s in record["stages"]] == [4, 8, 7, 8]
    assert sum(s["macs"] for s in record["stages"]) + record["stem"]["macs"] + record["classifier"]["macs"] == 24957968


def test_arch_table_accepts_text_form():
    result = run("arch", "-p", "paper-cifar100", "-c", "10", "-a", "d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]")
    assert result.returncode == 0, result.stderr
    assert "24,957,968" in result.stdout and "stage 4" in result.stdout


def test_help_everywhere():
    for command in ([], ["arch"], ["export"], ["init"], ["presets"]):
        result = run(*command, "--help")
        assert result.returncode == 0 and "Usage" in result.stdout


def test_user_preset_directory_is_listed():
    result = run("presets", env={"FEAST_EDGE_PRESET_PATH": str(TINY_PRESET.parent)})
    assert result.returncode == 0 and "test-tiny" in result.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["arch", "-p", "no-such-preset", "-a", JSON_ARCH], "unknown preset 'no-such-preset'; choose one of"),
        (["arch", "-p", "paper-cifar100", "-a", '{"d":[3,7'], "arch is not valid JSON"),
        (["arch", "-p", "paper-cifar100", "-a", JSON_ARCH.replace("[2,0,0,0,0]", "[2,0,0,0,12]")], "w[4] = 12 is out of range"),
        (["arch", "-p", "paper-cifar100", "-a", "d=1"], "cannot parse arch"),
    ],
)
def test_bad_arch_input_is_one_line(args, fragment):
    assert_user_error(run(*args), fragment)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small.safetensors"
    result = run("init", "--preset", "fmnist-small", "--out", str(path), "--seed", "1")
    assert result.returncode == 0, result.stderr
    return path


def test_export_writes_onnx(small_checkpoint, tmp_path, fashion_mnist_dir):
    out = tmp_path / "model.onnx"
    result = run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(out), "--calibration-data", str(fashion_mnist_dir), "--calibration-samples", "128")
    assert result.returncode == 0, result.stderr
    from feast_edge.onnx_export import read_metadata

    meta = read_metadata(out)
    assert meta["preset"] == "fmnist-small" and meta["bn_recalibrated"] == "true"


def test_export_refuses_checkpoint_of_another_preset(small_checkpoint, tmp_path):
    assert_user_error(
        run("export", "-k", str(small_checkpoint), "-p", "paper-cifar100", "-a", JSON_ARCH, "-o", str(tmp_path / "m.onnx")),
        "holds a supernet of preset 'fmnist-small', not 'paper-cifar100'",
    )


def test_export_refuses_unwritable_output(small_checkpoint, tmp_path):
    assert_user_error(
        run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(tmp_path / "missing" / "m.onnx")),
        "directory",
    )
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root ignores permission bits; the check must still refuse a directory target
        assert_user_error(run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(locked)), "it is a directory")
    else:
        assert_user_error(run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(locked / "m.onnx")), "not writable")


def test_export_refuses_arch_of_another_preset(small_checkpoint, tmp_path):
    assert_user_error(run("export", "-k", str(small_checkpoint), "-a", JSON_ARCH, "-o", str(tmp_path / "m.onnx")), "preset fmnist-small allows")


def test_export_refuses_pickle_checkpoint(tmp_path):
    bogus = tmp_path / "model.pt"
    bogus.write_bytes(b"\x80\x04\x95not-a-checkpoint")
    assert_user_error(run("export", "-k", str(bogus), "-a", SMALL_ARCH, "-o", str(tmp_path / "m.onnx")), "not a safetensors checkpoint")


def test_cache_build_and_show(tmp_path):
    out = tmp_path / "cache.json"
    result = run("cache", "build", "-p", "fmnist-small", "--targets", "8M,20M", "--population", "16", "--generations", "5", "-o", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["preset"] == "fmnist-small" and len(record["entries"]) in (1, 2)
    shown = run("cache", "show", "-p", "fmnist-small", "--cache", str(out))
    assert shown.returncode == 0 and "fmnist-small" in shown.stdout


def test_cache_of_another_preset_is_refused(tmp_path):
    out = tmp_path / "cache.json"
    assert run("cache", "build", "-p", "fmnist-small", "--targets", "8M", "--population", "8", "--generations", "2", "-o", str(out)).returncode == 0
    assert_user_error(run("cache", "show", "-p", "paper-cifar100", "--cache", str(out)), "not 'paper-cifar100'")


def test_extract_finds_an_arch_under_budget(small_checkpoint, tmp_path):
    result = run("extract", "-p", "fmnist-small", "--macs", "12M", "--population", "32", "--generations", "10", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["macs"] <= 12e6
    onnx_out = tmp_path / "extracted.onnx"
    result = run("extract", "-p", "fmnist-small", "--macs", "12M", "--population", "32", "--generations", "10", "-k", str(small_checkpoint), "-o", str(onnx_out))
    assert result.returncode == 0, result.stderr
    from feast_edge.onnx_export import read_metadata

    assert int(read_metadata(onnx_out)["macs"]) <= 12e6


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["extract", "-p", "fmnist-small", "--macs", "1M"], "below the smallest architecture"),
        (["extract", "-p", "fmnist-small", "--macs", "twelve"], "cannot read 'twelve' as a MAC count"),
        (["cache", "build", "-p", "fmnist-small", "--targets", ",", "-o", "/tmp/x.json"], "--targets is empty"),
    ],
)
def test_bad_search_input_is_one_line(args, fragment):
    assert_user_error(run(*args), fragment)
