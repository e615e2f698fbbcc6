"""The three console scripts as installed: one subprocess each proves that the entry point starts and keeps the user-error contract.

Everything else about the command lines (messages, exit codes, ``--help``,
output) is tested in this process through ``cli.invoke`` (tests/conftest.py),
which calls the same entry functions; real runs go through ``cli.run``
(``python -m``). These are the tests that start the scripts pip installed
(``make test``: ``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
# One user error per script, refused before anything is read, written or connected.
USER_ERRORS = {
    "feast-edge": (
        ("arch", "-p", "no-such-preset", "-a", '{"d":[0,0,0,0],"e":[0.5,0.5,0.5,0.5],"w":[0,0,0,0,0]}'),
        "unknown preset 'no-such-preset'; choose one of",
    ),
    "feast-server": (("status", "--out", "/nonexistent/feast-run"), "does not exist; point --out at"),
    "feast-agent": (
        (
            "run",
            "--broker",
            "mqtt://127.0.0.1:1",
            "--device-id",
            "d1",
            "--data",
            "/nonexistent",
            "--budget",
            "40M",
            "--amp",
            "int8",
        ),
        "--amp 'int8' is unknown",
    ),
}


def test_every_console_script_has_a_smoke_test_and_invoke_calls_its_entry_function(cli, server_cli, agent_cli) -> None:
    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert sorted(scripts) == sorted(USER_ERRORS)
    assert {
        c.prog: c.entry for c in (cli, server_cli, agent_cli)
    } == scripts  # what cli.invoke calls is what pip installs


@pytest.mark.slow  # several seconds (processes, a federation or a real simulation): out of the fast loop
@pytest.mark.parametrize("script", sorted(USER_ERRORS))
def test_the_installed_script_starts_and_a_user_error_is_one_line(script: str) -> None:
    found = shutil.which(script, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert found, (
        f"{script} is not installed beside {sys.executable} nor on PATH: pip install -e '.[dev]' (make venv does)"
    )
    args, fragment = USER_ERRORS[script]
    result = subprocess.run(
        [found, *args], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"}, check=False
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
