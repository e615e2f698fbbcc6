"""A full disk mid-run ends the run with one line naming the fix and the round kept, exit 2; the same command then
resumes (issue 21, item 7). On a real, tiny tmpfs where this process may mount one, and with an injected ENOSPC."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import feast_edge.util.atomic as atomic
from feast_edge.run.checkpoint import read_record
from simconfigs import cli_options, tiny_config

pytestmark = [pytest.mark.slow]  # real simulations

TINY = cli_options(tiny_config(seed=3, eval_every=10))  # each test gives its --rounds and --data after (the last wins)


def test_an_injected_enospc_on_the_second_checkpoint_is_one_line_and_the_run_resumes(
    cli, tmp_path: Path, fashion_mnist_dir, monkeypatch
) -> None:
    out = tmp_path / "run"
    writes = {"checkpoint": 0}
    original = atomic.os.fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if ".checkpoint.safetensors." in name:
            writes["checkpoint"] += 1
            if writes["checkpoint"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        original(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    args = ("simulate", "-o", str(out), *TINY, "--rounds", "3", "--data", str(fashion_mnist_dir))
    failed = cli.invoke(*args)
    cli.assert_user_error(failed, f"cannot write the checkpoint to {out / 'checkpoint.safetensors'}: no space left")
    assert "free space and rerun the same command (the last good checkpoint, round 1, is intact)" in failed.stderr
    assert failed.returncode == 2
    assert read_record(out / "checkpoint.safetensors")["fields"]["round"] == 1
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no torn temporary left behind
    monkeypatch.setattr(atomic.os, "fsync", original)
    resumed = cli.invoke(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert read_record(out / "checkpoint.safetensors")["fields"]["round"] == 3


def test_a_real_full_filesystem_is_one_line(cli, tmp_path: Path, fashion_mnist_dir) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    probe = tmp_path / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    # The first checkpoint fits; the second needs room beside it (the previous one is kept until it is written).
    first = cli.run("simulate", "-o", str(probe), *TINY, "--rounds", "1", "--data", str(fashion_mnist_dir))
    assert first.returncode == 0, first.stderr
    size = (probe / "checkpoint.safetensors").stat().st_size
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.6) + 256 * 1024}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"this process may not mount a tmpfs ({mounted.stderr.strip()}); the injected ENOSPC test covers it"
        )
    try:
        out = mount / "run"
        result = cli.run("simulate", "-o", str(out), *TINY, "--rounds", "3", "--data", str(fashion_mnist_dir))
        cli.assert_user_error(result, "no space left on device; free space and rerun the same command")
        assert result.returncode == 2
        kept = read_record(out / "checkpoint.safetensors")["fields"]["round"]
        assert f"round {kept}, is intact" in result.stderr
    finally:
        subprocess.run(["umount", str(mount)], check=False)
