"""``feast-edge dashboard``: browse and compare finished runs in the web dashboard (the page ``--dashboard`` serves live)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from feast_edge.cli.common import make_console

console = make_console()


def register(app: typer.Typer) -> None:
    """Add ``dashboard`` to the ``feast-edge`` app."""
    app.command()(dashboard)


def dashboard(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR",
            help="Run directories: 'feast-edge simulate --out' (results.json) or 'feast-server run --out'.",
        ),
    ],
    bind: Annotated[
        str, typer.Option("--bind", help="PORT or HOST:PORT to serve on (port 0: any free port).")
    ] = "127.0.0.1:8765",
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="FEAST_DASHBOARD_TOKEN",
            help="Access token the page asks for; required unless bound to loopback.",
        ),
    ] = None,
) -> None:
    """Serve finished runs in the web dashboard: fleet, rounds, accuracy vs MACs, traffic, models; several runs side by side."""
    from feast_edge.dashboard import load_runs, start_dashboard

    state = load_runs(run_dirs)
    served = start_dashboard(state, bind, token, option="--bind", token_option="--token")
    what = f"{len(run_dirs)} runs" if len(run_dirs) > 1 else str(run_dirs[0])
    console.print(f"dashboard of {what}: {served.url}", soft_wrap=True, highlight=False, markup=False)
    console.print("Ctrl-C stops it", soft_wrap=True, highlight=False, markup=False)
    console.file.flush()  # a supervising script reads the URL from a pipe
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopped", soft_wrap=True, highlight=False, markup=False)
    finally:
        served.stop()
