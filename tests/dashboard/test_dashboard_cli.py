"""``feast-edge dashboard`` as a user runs it: user errors are one line, exit status 2."""

from __future__ import annotations

from pathlib import Path


def test_a_missing_run_directory_is_one_error_line(cli, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    result = cli.run("dashboard", str(missing))
    assert result.returncode == 2
    cli.assert_user_error(result, f"run directory {missing} does not exist; a run directory holds results.json (feast-edge simulate --out)")


def test_a_folder_that_is_no_run_is_one_error_line(cli, tmp_path: Path) -> None:
    result = cli.run("dashboard", str(tmp_path))
    assert result.returncode == 2
    cli.assert_user_error(result, f"{tmp_path} is not a run directory")


def test_bind_errors_name_the_commands_options(cli, simulation_run: Path) -> None:
    result = cli.run("dashboard", str(simulation_run), "--bind", "x:y")
    assert result.returncode == 2
    cli.assert_user_error(result, "--bind 'x:y': expected PORT or HOST:PORT, e.g. 8765 or 0.0.0.0:8765")
    result = cli.run("dashboard", str(simulation_run), "--bind", "0.0.0.0:0")
    assert result.returncode == 2
    cli.assert_user_error(result, "--bind on 0.0.0.0 is reachable from other machines; give --token TOKEN (or bind 127.0.0.1)")


def test_server_and_simulate_refuse_an_open_dashboard_without_a_token_before_starting(server_cli, cli, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = server_cli.run("run", "--broker", "mqtt://127.0.0.1:1883", "--out", str(out), "--dashboard", "0.0.0.0:8765")
    assert result.returncode == 2
    server_cli.assert_user_error(result, "--dashboard on 0.0.0.0 is reachable from other machines; give --dashboard-token TOKEN (or bind 127.0.0.1)")
    assert not out.exists()  # refused before anything was created or connected
    result = cli.run("simulate", "--out", str(out), "--dashboard", "192.0.2.7:8765")
    cli.assert_user_error(result, "--dashboard on 192.0.2.7 is reachable from other machines; give --dashboard-token TOKEN")
    result = cli.run("demo", "--out", str(out), "--dashboard", "not-a-port")
    cli.assert_user_error(result, "--dashboard 'not-a-port': expected PORT or HOST:PORT")


def test_tensorboard_without_the_package_is_one_error_line(cli, tmp_path: Path) -> None:
    # A sitecustomize that hides the tensorboard package, as on an install without the extra.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\nsys.modules['torch.utils.tensorboard'] = None\n")
    result = cli.run(
        "simulate", "--out", str(tmp_path / "run"), "--clients", "2", "--per-round", "1", "--rounds", "1", "--train-limit", "100",
        "--val-samples", "50", "--calib-samples", "20", "--tensorboard", env={"PYTHONPATH": str(hide)}, timeout=300,
    )
    cli.assert_user_error(result, "--tensorboard needs the tensorboard package: pip install 'feast-edge[tensorboard]'")
