"""``feast-edge dashboard`` (and --dashboard, --tensorboard) at the command line: user errors are one line, exit status 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def test_a_missing_run_directory_is_one_error_line(cli, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    result = cli.invoke("dashboard", str(missing))
    assert result.returncode == 2
    cli.assert_user_error(
        result,
        f"run directory {missing} does not exist; a run directory holds results.json (feast-edge simulate --out)",
    )


def test_a_folder_that_is_no_run_is_one_error_line(cli, tmp_path: Path) -> None:
    result = cli.invoke("dashboard", str(tmp_path))
    assert result.returncode == 2
    cli.assert_user_error(result, f"{tmp_path} is not a run directory")


def test_bind_errors_name_the_commands_options(cli, simulation_run: Path) -> None:
    result = cli.invoke("dashboard", str(simulation_run), "--bind", "x:y")
    assert result.returncode == 2
    cli.assert_user_error(result, "--bind 'x:y': expected PORT or HOST:PORT, e.g. 8765 or 0.0.0.0:8765")
    result = cli.invoke("dashboard", str(simulation_run), "--bind", "0.0.0.0:0")
    assert result.returncode == 2
    cli.assert_user_error(
        result, "--bind on 0.0.0.0 is reachable from other machines; give --token TOKEN (or bind 127.0.0.1)"
    )


def test_server_and_simulate_refuse_an_open_dashboard_without_a_token_before_starting(
    server_cli, cli, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    result = server_cli.invoke(
        "run", "--broker", "mqtt://127.0.0.1:1883", "--out", str(out), "--dashboard", "0.0.0.0:8765"
    )
    assert result.returncode == 2
    server_cli.assert_user_error(
        result,
        "--dashboard on 0.0.0.0 is reachable from other machines; give --dashboard-token TOKEN (or bind 127.0.0.1)",
    )
    assert not out.exists()  # refused before anything was created or connected
    result = cli.invoke("simulate", "--out", str(out), "--dashboard", "192.0.2.7:8765")
    cli.assert_user_error(
        result, "--dashboard on 192.0.2.7 is reachable from other machines; give --dashboard-token TOKEN"
    )
    result = cli.invoke("demo", "--out", str(out), "--dashboard", "not-a-port")
    cli.assert_user_error(result, "--dashboard 'not-a-port': expected PORT or HOST:PORT")


def test_tensorboard_without_the_package_is_one_error_line(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hide the tensorboard package, as on an install without the extra: importing it raises ImportError.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    result = cli.invoke(
        "simulate",
        "--out",
        str(tmp_path / "run"),
        "--clients",
        "2",
        "--per-round",
        "1",
        "--rounds",
        "1",
        "--train-limit",
        "100",
        "--val-samples",
        "50",
        "--calib-samples",
        "20",
        "--tensorboard",
    )
    cli.assert_user_error(result, "--tensorboard needs the tensorboard package: pip install 'feast-edge[tensorboard]'")
