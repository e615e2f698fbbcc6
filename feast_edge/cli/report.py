"""``feast-edge report``: compare finished simulation runs (and feast-server runs) in one Markdown or HTML report with plots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from feast_edge.cli.common import make_console

console = make_console()
errors = make_console(stderr=True)


def register(app: typer.Typer) -> None:
    """Add ``report`` to the ``feast-edge`` app."""
    app.command()(report)


def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR",
            help="Run directories of 'feast-edge simulate --out' (each with its results.json) or 'feast-server run --out'.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the report and its PNG plots.")] = Path(
        "report"
    ),
    fmt: Annotated[
        str, typer.Option("--format", help="markdown (report.md, PNG links) or html (report.html, PNGs embedded).")
    ] = "markdown",
    title: Annotated[
        str | None, typer.Option("--title", help="Report title (default: 'feast-edge report: PRESET').")
    ] = None,
) -> None:
    """Compare runs: per-method accuracy (mean ± std over seeds), gaps to the centralized reference, traffic, compute, plots;
    for a feast-server run, where it validated and calibrated its models."""
    from feast_edge.report.summary import write_report

    written = write_report(run_dirs, out, fmt, title)
    for warning in written.warnings:
        errors.print(warning, soft_wrap=True, highlight=False, markup=False)
    for path in (written.report, *written.plots):
        console.print(f"wrote {path}", soft_wrap=True, highlight=False, markup=False)
