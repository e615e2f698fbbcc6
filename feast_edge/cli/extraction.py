"""``feast-edge extraction-gap``: post-hoc extraction of uncached variants of a finished run, against its cached curve."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from feast_edge.cli.common import make_console, millions, parse_macs
from feast_edge.cli.progress import Stage
from feast_edge.errors import FeastError

console = make_console()
EXTRACTION = "extraction.json"


def register(app: typer.Typer) -> None:
    """Add ``extraction-gap`` to the ``feast-edge`` app."""
    app.command("extraction-gap")(extraction_gap)


def extraction_gap(
    run: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A finished 'feast-edge simulate' run of FEAST.")],
    points: Annotated[int, typer.Option("--points", "-n", help="MAC targets to search (paper: 14 over 25–52M).")] = 14,
    low: Annotated[
        Optional[str], typer.Option("--low", help="Lowest MAC target, e.g. 5M (default: the smallest cached variant).")
    ] = None,
    high: Annotated[
        Optional[str], typer.Option("--high", help="Highest MAC target (default: the largest cached variant).")
    ] = None,
    population: Annotated[int, typer.Option("--population", help="Search population (paper: 512).")] = 64,
    generations: Annotated[int, typer.Option("--generations", help="Search generations (paper: 512).")] = 64,
    seed: Annotated[int, typer.Option("--seed", help="Search seed.")] = 0,
) -> None:
    """Search the best architecture under N MAC targets, extract it from the run's supernet, recalibrate BN, test it,
    and report its gap to the cached-variant curve (written to RUN_DIR/extraction.json; feast-edge report shows it)."""
    from feast_edge.evaluate.extraction import extraction_gaps, mean_abs_gap, target_budgets
    from feast_edge.run.checkpoint import load_supernet
    from feast_edge.sim.setup import SimulationConfig, build_setup

    if points < 1 or population < 4 or generations < 1:
        raise FeastError("--points, --generations must be at least 1 and --population at least 4")
    results = _finished_feast_run(run)
    config = SimulationConfig.recorded(results["config"])
    setup = build_setup(config)
    cached = [float(v["test_accuracy"]) for v in sorted(results["variants"], key=lambda v: v["index"])]
    if len(cached) != len(setup.cache.entries):
        raise FeastError(f"{run}/results.json lists {len(cached)} variants, its cache has {len(setup.cache.entries)}")
    macs = [e.macs for e in setup.cache.entries]
    lo = parse_macs(low) if low is not None else float(min(macs))
    hi = parse_macs(high) if high is not None else float(max(macs))
    if not min(macs) <= lo <= hi <= max(macs):
        raise FeastError(
            f"--low/--high {millions(lo)}–{millions(hi)} must lie within the cached range "
            f"{millions(min(macs))}–{millions(max(macs))} MACs, low <= high (the gap is measured against that curve)"
        )
    checkpoint = run / "best.safetensors" if (run / "best.safetensors").is_file() else run / "checkpoint.safetensors"
    supernet, _ = load_supernet(checkpoint, setup.preset)
    images, labels = setup.test_set.images, setup.test_set.labels
    if config.test_limit is not None:
        images, labels = images[: config.test_limit], labels[: config.test_limit]
    began = time.monotonic()
    with Stage(console, "search, extract, test", points) as stage:
        found = extraction_gaps(
            supernet,
            setup.cache,
            cached,
            target_budgets(lo, hi, points),
            setup.calibration_images(),
            images,
            labels,
            seed=seed,
            population=population,
            generations=generations,
            device=config.device,
            progress=lambda done, total: stage.update(done),
        )
    gap = mean_abs_gap(found)
    record = {
        "run": str(run),
        "checkpoint": checkpoint.name,
        "range": [lo, hi],
        "search": {"population": population, "generations": generations, "seed": seed},
        "test_samples": int(labels.shape[0]),
        "points": [e.to_dict() for e in found],
        "uncached": sum(not e.cached for e in found),
        "mean_abs_gap": gap,
        "seconds": time.monotonic() - began,
    }
    from feast_edge.util.atomic import atomic_write_bytes

    atomic_write_bytes(run / EXTRACTION, json.dumps(record, indent=2).encode())
    table = Table(title=f"Post-hoc extraction, {run}: {points} targets over {millions(lo)}–{millions(hi)} MACs")
    for col in ("target", "MACs", "params", "accuracy", "cached curve", "gap (points)", "arch"):
        table.add_column(col, justify="left" if col == "arch" else "right")
    for e in found:
        table.add_row(
            millions(e.target_macs),
            millions(e.macs),
            millions(e.params),
            f"{100 * e.accuracy:.2f}%",
            f"{100 * e.curve:.2f}%",
            f"{e.gap:+.2f}" + (" (cached)" if e.cached else ""),
            json.dumps(e.arch, separators=(",", ":")),
        )
    console.print(table)
    said = "none: every architecture found is cached" if gap is None else f"{gap:.2f} points"
    console.print(f"mean |gap| over {record['uncached']} uncached architectures: {said} (paper, CIFAR-100: 1.14)")
    console.print(f"wrote {run / EXTRACTION}", soft_wrap=True, highlight=False, markup=False)


def _finished_feast_run(run: Path) -> dict:
    """The results.json of a finished FEAST simulation in ``run``; a one-line error otherwise."""
    path = run / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
        method, variants, config = results.get("method", "feast"), results["variants"], results["config"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise FeastError(
            f"cannot read {path} ({exc!r}); pass the directory of a finished feast-edge simulate run"
        ) from None
    if method != "feast" or not isinstance(variants, list) or not isinstance(config, dict):
        raise FeastError(
            f"{run} is a {method} run; post-hoc extraction applies to FEAST's supernet (a --method feast run)"
        )
    return results
