"""The commands' options come from the run's settings and are shown in ``--help`` by concern."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.main import get_command

from cli_parameters import parameters, recorded
from feast_edge.cli.main import app as feast_edge_app
from feast_edge.cli.panels import PANELS
from feast_edge.server.cli import app as server_app
from feast_edge.server.config import ServerConfig
from feast_edge.settings.nested import concern_of_keys, declared_help, defaults, help_of
from feast_edge.sim.config import SimulationConfig

RENAMED = {"local_epochs": "epochs", "data": "data_dir", "method_option": "method_options", "profiles": "budgets"}


def _params(app, command: str) -> dict:
    return {p.name: p for p in get_command(app).commands[command].params}


@pytest.mark.parametrize(
    ("app", "command", "config", "renamed"),
    [
        (server_app, "run", ServerConfig, {"local_epochs": "epochs"}),
        (feast_edge_app, "simulate", SimulationConfig, RENAMED),
    ],
    ids=["feast-server run", "feast-edge simulate"],
)
def test_every_setting_option_sits_in_its_concerns_panel(app, command, config, renamed) -> None:
    concerns = concern_of_keys(config)
    params = _params(app, command)
    settings = {name: renamed.get(name, name) for name in params if renamed.get(name, name) in concerns}
    assert len(settings) >= 40  # most of a run's settings are options
    for name, key in settings.items():
        assert params[name].rich_help_panel == PANELS[concerns[key]], name
    others = {p.rich_help_panel for name, p in params.items() if name not in settings and name != "help"}
    assert others <= {"Process and output", "Broker", None}


def test_the_commands_keep_their_recorded_parameters() -> None:
    # tests/data/cli-parameters.json: names, types, defaults, bounds and panels (python tests/cli_parameters.py record).
    now, before = parameters(), recorded()
    assert now.keys() == before.keys()
    for command in now:
        was = {p["name"]: p for p in before[command]}
        moved = {
            p["name"]: {
                what: (was[p["name"]][what], value) for what, value in p.items() if was[p["name"]][what] != value
            }
            for p in now[command]
            if p["name"] in was and was[p["name"]] != p
        }
        assert not moved, f"{command}: (recorded, now) {moved}"
        assert [p["name"] for p in now[command]] == list(was), command  # none added, none removed


# Options of settings that read them in a form of their own, with their help beside the command.
OWN_HELP = {
    "simulate": {"method", "method_options", "recipe", "device", "amp", "deterministic", "personalize", "holdout",
                 "budgets"},
    "run": {"out", "federation"},
}  # fmt: skip


@pytest.mark.parametrize(
    ("app", "command", "config", "renamed", "shown"),
    [
        (server_app, "run", ServerConfig, {"local_epochs": "epochs"}, "server"),
        (feast_edge_app, "simulate", SimulationConfig, RENAMED, "simulation"),
    ],
    ids=["feast-server run", "feast-edge simulate"],
)
def test_every_setting_options_help_is_its_declaration_as_the_app_shows_it(
    app, command, config, renamed, shown
) -> None:
    declared, texts = declared_help(config), help_of(config, shown)
    params = _params(app, command)
    keys = {name: renamed.get(name, name) for name in params if renamed.get(name, name) in concern_of_keys(config)}
    for name, key in keys.items():
        if key in declared:
            words = getattr(declared[key], shown)
            assert params[name].help == texts[key] == (f"{declared[key].core} {words}" if words else declared[key].core)
    assert set(keys.values()) - set(declared) == OWN_HELP[command]
    assert len(set(keys.values()) & set(declared)) >= 40


def test_the_servers_option_defaults_are_its_settings_defaults() -> None:
    params, values = _params(server_app, "run"), defaults(ServerConfig, out="")
    for name, param in params.items():
        key = "epochs" if name == "local_epochs" else name
        if key in values and key not in ("out", "federation", "server_betas"):
            assert param.default == values[key], name
    assert params["server_betas"].default == "0.9,0.99"


@pytest.mark.slow  # a fresh feast-server process: out of the fast loop
def test_server_help_lists_options_under_each_concern() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "feast_edge.server.cli", "run", "--help"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "120", "PATH": ""},
    )
    assert shown.returncode == 0, shown.stderr
    panels = [line.split("─ ")[1].split(" ─")[0] for line in shown.stdout.splitlines() if line.startswith("╭─ ")]
    for panel in ("Population", "Training", "Aggregation", "Privacy", "Validation", "Serving", "Network", "Broker"):
        assert panel in panels
    assert "--dp-clip" in shown.stdout.split("─ Privacy ")[1].split("╰")[0]
