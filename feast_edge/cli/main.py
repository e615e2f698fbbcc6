"""``feast-edge`` command line: inspect presets and architectures, create and export models; the run commands are in ``runs``.

User errors (bad preset, arch, path, checkpoint) print one ``error:`` line to
stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from feast_edge.cli.common import ArchOpt, PresetOpt, make_app, make_console, millions, parse_macs, run_cli
from feast_edge.cli.dashboard import register as register_dashboard
from feast_edge.cli.export import register as register_export
from feast_edge.cli.extraction import register as register_extraction
from feast_edge.cli.flower import register as register_flower
from feast_edge.cli.preset import register as register_preset
from feast_edge.cli.report import register as register_report
from feast_edge.cli.runs import register as register_runs
from feast_edge.errors import FeastError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import cost_breakdown
from feast_edge.space.geometry import arch_layout, supernet_layout
from feast_edge.space.preset import BUILTIN_DIR, available_presets, load_preset

app = make_app("feast-edge", "Federated shared-space training (FEAST): one elastic network, a model for every device.")
console = make_console()

ClassesOpt = Annotated[
    int | None, typer.Option("--classes", "-c", min=1, help="Classifier classes (default: the preset's).")
]


@app.command()
def presets() -> None:
    """List the available presets (built-in and on $FEAST_EDGE_PRESET_PATH)."""
    table = Table(title="feast-edge presets")
    for col in ("preset", "input", "classes", "stages", "full MACs", "full params", "source"):
        table.add_column(col, justify="right" if "full" in col or col == "classes" else "left", no_wrap=col != "source")
    for name, file in available_presets().items():
        p = load_preset(name)
        layout = supernet_layout(p)
        parts = cost_breakdown(layout)
        table.add_row(
            name,
            f"{p.in_channels}x{p.input_size}x{p.input_size}",
            str(p.classes),
            str(p.num_stages),
            millions(sum(x.macs for x in parts)),
            millions(sum(x.params for x in parts)),
            "built-in" if file.parent == BUILTIN_DIR else str(file),
        )
    console.print(table)


@app.command("arch")
def arch_command(
    preset: PresetOpt,
    arch: ArchOpt,
    classes: ClassesOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Show the MACs, parameters and per-stage geometry of one architecture."""
    p = load_preset(preset)
    a = Arch.parse(arch).validated(p)
    layout = arch_layout(p, a, classes)
    parts = cost_breakdown(layout)
    macs, params = sum(x.macs for x in parts), sum(x.params for x in parts)
    if as_json:
        stages = [
            {
                "blocks": s.blocks,
                "channels": s.channels,
                "mid": s.mid,
                "stride": s.stride,
                "resolution": s.resolution,
                "macs": c.macs,
                "params": c.params,
            }
            for s, c in zip(layout.stages, parts[1:-1])
        ]
        record = {
            "preset": p.name,
            "arch": a.to_dict(),
            "classes": layout.classes,
            "macs": macs,
            "params": params,
            "stem": {
                "channels": layout.stem_channels,
                "resolution": layout.stem_resolution,
                "macs": parts[0].macs,
                "params": parts[0].params,
            },
            "stages": stages,
            "classifier": {
                "in_features": layout.last_channels,
                "classes": layout.classes,
                "macs": parts[-1].macs,
                "params": parts[-1].params,
            },
        }
        typer.echo(json.dumps(record))
        return
    table = Table(title=f"{p.name}  {a}", caption=f"{layout.classes}-class head; MACs per example")
    for col in ("part", "blocks", "channels", "mid", "resolution", "MACs", "params"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for (part, blocks, channels, mid, res), cost in zip(layout.summary_rows(), parts):
        table.add_row(
            part, str(blocks), str(channels), str(mid or "-"), f"{res}x{res}", f"{cost.macs:,}", f"{cost.params:,}"
        )
    table.add_row(
        "classifier",
        "-",
        f"{layout.last_channels}->{layout.classes}",
        "-",
        "-",
        f"{parts[-1].macs:,}",
        f"{parts[-1].params:,}",
    )
    table.add_section()
    table.add_row("total", "", "", "", "", f"{macs:,}", f"{params:,}", style="bold")
    console.print(table)


@app.command()
def init(
    preset: PresetOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Checkpoint file to write (.safetensors).")],
    classes: ClassesOpt = None,
    seed: Annotated[int, typer.Option(help="Seed of the weight initialization.")] = 0,
) -> None:
    """Write a freshly initialized supernet checkpoint."""
    from feast_edge.run.checkpoint import save_supernet
    from feast_edge.space.supernet import Supernet

    p = load_preset(preset)
    model = Supernet(p, classes=classes, seed=seed)
    save_supernet(out, model, seed=seed, round=0)
    console.print(
        f"wrote {out}: preset {p.name}, {model.classes} classes, {sum(t.numel() for t in model.parameters()):,} params",
        soft_wrap=True,
    )


cache_app = typer.Typer(help="Build and inspect fixed variant caches (method §3).", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


def _cache_table(cache, title: str) -> Table:
    table = Table(title=title)
    for col in ("#", "MACs", "params", "fitness", "rho", "target(s)", "arch"):
        table.add_column(col, justify="left" if col == "arch" else "right", no_wrap=col != "arch")
    for i, entry in enumerate(cache.entries):
        targets = ", ".join(millions(int(job.target)) for job in entry.jobs)
        table.add_row(
            str(i),
            millions(entry.macs),
            millions(entry.params),
            f"{entry.fitness:.1f}",
            f"{entry.rho:.3f}",
            targets,
            str(entry.arch),
        )
    return table


@cache_app.command("build")
def cache_build(
    preset: PresetOpt,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Cache JSON to write (default for a preset file my.toml: my.cache.json beside it)."
        ),
    ] = None,
    targets: Annotated[
        str | None,
        typer.Option(help="Comma-separated MAC targets (e.g. 25M,50M); default: the preset's [cache] segments."),
    ] = None,
    rho0: Annotated[
        float | None,
        typer.Option(help="Effectiveness ceiling for --targets (default: the preset's extraction ceilings)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Base seed; target k uses seed + k.")] = 42,
    population: Annotated[int, typer.Option(min=4, help="GA population per target.")] = 256,
    generations: Annotated[int, typer.Option(min=1, help="GA generations per target.")] = 512,
    workers: Annotated[int, typer.Option(min=1, help="Parallel worker processes.")] = 1,
) -> None:
    """Search the best architecture for every MAC target and write the cache (one GA per target)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from feast_edge.cache.build import build_cache, cache_targets
    from feast_edge.cache.search import extraction_rho0
    from feast_edge.cache.variants import user_cache_path
    from feast_edge.util.atomic import check_writable

    p = load_preset(preset)
    if out is None:
        out = user_cache_path(p)
        if out is None:
            raise FeastError(f"give --out FILE: preset {p.name} is built in, and its shipped cache is not overwritten")
    check_writable(out, "cache")
    jobs = None
    if targets is not None:
        values = [parse_macs(t) for t in targets.split(",") if t.strip()]
        if not values:
            raise FeastError("--targets is empty; give at least one MAC target, e.g. --targets 25M,50M")
        jobs = [(v, rho0 if rho0 is not None else extraction_rho0(p, v)) for v in values]
    with Progress(
        TextColumn("[bold]cache search"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        task = bar.add_task("targets", total=len(jobs) if jobs is not None else len(cache_targets(p)))
        cache = build_cache(
            p,
            jobs,
            seed=seed,
            population=population,
            generations=generations,
            workers=workers,
            progress=lambda done, total, _r: bar.update(task, completed=done, total=total),
        )
    cache.save(out)
    console.print(_cache_table(cache, f"{p.name}: {len(cache)} variants"))
    console.print(f"wrote {out}", soft_wrap=True)


@cache_app.command("show")
def cache_show(
    preset: PresetOpt,
    cache_file: Annotated[
        Path | None,
        typer.Option("--cache", help="Cache JSON (default: the one beside the preset's file, else the shipped one)."),
    ] = None,
) -> None:
    """List a cache's variants: MACs, params, fitness, rho, arch."""
    from feast_edge.cache.variants import load_cache

    p = load_preset(preset)
    cache = load_cache(p, cache_file)
    console.print(_cache_table(cache, f"{p.name}: {len(cache)} variants ({cache.classes}-class head)"))


register_runs(app)
register_report(app)
register_dashboard(app)
register_preset(app)
register_export(app)
register_extraction(app)
register_flower(app)


def main() -> None:
    """Console-script entry of ``feast-edge``."""
    run_cli(app)


if __name__ == "__main__":
    main()
