"""``feast-edge flower new``: the Flower App project it writes, and its errors (flwr missing, files in the way)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from feast_edge.flower.serverapp.run_config import server_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _new(repo: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "feast_edge.cli", "flower", "new", *args],
        capture_output=True,
        text=True,
        cwd=repo,
        env=env,
        timeout=120,
    )


def test_the_project_names_feast_edges_apps_and_its_config_is_feast_servers(cli, tmp_path: Path) -> None:
    done = cli.invoke(
        "flower", "new", str(tmp_path / "My App"), "--rounds", "7", "--per-round", "3", "--data", "/srv/val"
    )
    assert done.returncode == 0, done.stderr
    project = tomllib.loads((tmp_path / "My App" / "pyproject.toml").read_text())
    assert project["project"]["name"] == "my-app"
    components = project["tool"]["flwr"]["app"]["components"]
    for ref in components.values():  # each component imports and is the app object Flower calls
        module, attr = ref.split(":")
        assert type(getattr(importlib.import_module(module), attr)).__name__ in ("ServerApp", "ClientApp")
    config, export = server_config(project["tool"]["flwr"]["app"]["config"])  # every key is one the ServerApp takes
    assert (config.training.rounds, config.population.per_round, config.data, export) == (7, 3, "/srv/val", True)
    assert config.out == str((tmp_path / "My App" / "run").resolve())
    assert "run/" in (tmp_path / "My App" / ".gitignore").read_text()  # the run directory stays out of the app bundle


def test_existing_files_are_not_overwritten_without_force(cli, tmp_path: Path) -> None:
    assert cli.invoke("flower", "new", str(tmp_path / "app")).returncode == 0
    again = cli.invoke("flower", "new", str(tmp_path / "app"))
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "pyproject.toml already exists; choose another directory or pass --force" in again.stderr
    assert cli.invoke("flower", "new", str(tmp_path / "app"), "--force").returncode == 0


@pytest.mark.slow  # several seconds of fresh interpreters and Flower's commands: out of the fast loop
def test_without_flwr_one_line_names_the_extra(repo: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker" / "flwr"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('flwr is not installed here')\n")
    env = {"PYTHONPATH": f"{blocker.parent}:{repo}", "PATH": "/usr/bin:/bin"}
    done = _new(repo, str(tmp_path / "app"), env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "error: Flower is not installed: pip install 'feast-edge[flower]' (flwr>=1.42,<1.43) "
        "to run feast-edge on Flower\n"
    )
    assert not (tmp_path / "app").exists()


@pytest.mark.slow  # several seconds of fresh interpreters and Flower's commands: out of the fast loop
def test_flowers_own_commands_run_in_this_environment() -> None:
    """The extra's pins give a working flwr CLI: flwr 1.42 declares typer>=0.13 but needs typer>=0.19 (pyproject.toml),
    which a resolver pulled down to amqtt's typer==0.15.4 once; the Flower tests and the user's `flwr run` need it."""
    bin_dir = Path(sys.executable).parent
    started = {  # side by side: each is an interpreter importing Flower
        name: subprocess.Popen(
            [str(bin_dir / name), "--help"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for name in ("flwr", "flower-superlink", "flower-supernode")
    }
    for name, process in started.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, f"{name} does not start here:\n{stderr[-2000:]}"
