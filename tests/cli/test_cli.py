"""The feast-edge command line, run as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from strategies import TINY_PRESET

JSON_ARCH = '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}'
SMALL_ARCH = '{"d":[1,0,1,0],"e":[0.5,0.5,0.5,0.5],"w":[2,2,2,2,2]}'




def test_arch_json_reports_spec_figures(cli):
    result = cli.run("arch", "--preset", "paper-cifar100", "--classes", "10", "--json", "--arch", JSON_ARCH)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["macs"], record["params"]) == (24957968, 327522)
    assert [s["blocks"] for s in record["stages"]] == [4, 8, 7, 8]
    assert sum(s["macs"] for s in record["stages"]) + record["stem"]["macs"] + record["classifier"]["macs"] == 24957968


def test_arch_table_accepts_text_form(cli):
    result = cli.run("arch", "-p", "paper-cifar100", "-c", "10", "-a", "d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]")
    assert result.returncode == 0, result.stderr
    assert "24,957,968" in result.stdout and "stage 4" in result.stdout


def test_help_everywhere(cli):
    for command in ([], ["arch"], ["export"], ["init"], ["presets"]):
        result = cli.run(*command, "--help")
        assert result.returncode == 0 and "Usage" in result.stdout


def test_user_preset_directory_is_listed(cli):
    result = cli.run("presets", env={"FEAST_EDGE_PRESET_PATH": str(TINY_PRESET.parent)})
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
def test_bad_arch_input_is_one_line(cli, args, fragment):
    cli.assert_user_error(cli.run(*args), fragment)


@pytest.fixture(scope="module")
def small_checkpoint(cli, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small.safetensors"
    result = cli.run("init", "--preset", "fmnist-small", "--out", str(path), "--seed", "1")
    assert result.returncode == 0, result.stderr
    return path


def test_export_writes_onnx(cli, small_checkpoint, tmp_path, fashion_mnist_dir):
    out = tmp_path / "model.onnx"
    result = cli.run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(out), "--calibration-data", str(fashion_mnist_dir), "--calibration-samples", "128")
    assert result.returncode == 0, result.stderr
    from feast_edge.onnx_export import read_metadata

    meta = read_metadata(out)
    assert meta["preset"] == "fmnist-small" and meta["bn_recalibrated"] == "true"


def test_export_refuses_checkpoint_of_another_preset(cli, small_checkpoint, tmp_path):
    cli.assert_user_error(
        cli.run("export", "-k", str(small_checkpoint), "-p", "paper-cifar100", "-a", JSON_ARCH, "-o", str(tmp_path / "m.onnx")),
        "holds a supernet of preset 'fmnist-small', not 'paper-cifar100'",
    )


def test_export_refuses_unwritable_output(cli, small_checkpoint, tmp_path):
    cli.assert_user_error(
        cli.run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(tmp_path / "missing" / "m.onnx")),
        "directory",
    )
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root ignores permission bits; the check must still refuse a directory target
        cli.assert_user_error(cli.run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(locked)), "it is a directory")
    else:
        cli.assert_user_error(cli.run("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(locked / "m.onnx")), "not writable")


def test_export_refuses_arch_of_another_preset(cli, small_checkpoint, tmp_path):
    cli.assert_user_error(cli.run("export", "-k", str(small_checkpoint), "-a", JSON_ARCH, "-o", str(tmp_path / "m.onnx")), "preset fmnist-small allows")


def test_export_refuses_pickle_checkpoint(cli, tmp_path):
    bogus = tmp_path / "model.pt"
    bogus.write_bytes(b"\x80\x04\x95not-a-checkpoint")
    cli.assert_user_error(cli.run("export", "-k", str(bogus), "-a", SMALL_ARCH, "-o", str(tmp_path / "m.onnx")), "not a safetensors checkpoint")


def test_cache_build_and_show(cli, tmp_path):
    out = tmp_path / "cache.json"
    result = cli.run("cache", "build", "-p", "fmnist-small", "--targets", "8M,20M", "--population", "16", "--generations", "5", "-o", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["preset"] == "fmnist-small" and len(record["entries"]) in (1, 2)
    shown = cli.run("cache", "show", "-p", "fmnist-small", "--cache", str(out))
    assert shown.returncode == 0 and "fmnist-small" in shown.stdout


def test_cache_of_another_preset_is_refused(cli, tmp_path):
    out = tmp_path / "cache.json"
    assert cli.run("cache", "build", "-p", "fmnist-small", "--targets", "8M", "--population", "8", "--generations", "2", "-o", str(out)).returncode == 0
    cli.assert_user_error(cli.run("cache", "show", "-p", "paper-cifar100", "--cache", str(out)), "not 'paper-cifar100'")


def test_extract_finds_an_arch_under_budget(cli, small_checkpoint, tmp_path):
    result = cli.run("extract", "-p", "fmnist-small", "--macs", "12M", "--population", "32", "--generations", "10", "--json")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["macs"] <= 12e6
    onnx_out = tmp_path / "extracted.onnx"
    result = cli.run("extract", "-p", "fmnist-small", "--macs", "12M", "--population", "32", "--generations", "10", "-k", str(small_checkpoint), "-o", str(onnx_out))
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
def test_bad_search_input_is_one_line(cli, args, fragment):
    cli.assert_user_error(cli.run(*args), fragment)
