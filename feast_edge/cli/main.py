"""``feast-edge`` command line: inspect presets and architectures, create and export models.

User errors (bad preset, arch, path, checkpoint) print one ``error:`` line to
stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from feast_edge.arch import Arch
from feast_edge.cli.common import DeviceOpt, make_app, make_console, parse_list, parse_macs, run_cli
from feast_edge.cost import arch_cost, cost_breakdown
from feast_edge.errors import FeastError
from feast_edge.geometry import arch_layout, supernet_layout
from feast_edge.preset import BUILTIN_DIR, available_presets, load_preset

app = make_app("feast-edge", "Federated shared-space training (FEAST): one elastic network, a model for every device.")
console = make_console()

PresetOpt = Annotated[str, typer.Option("--preset", "-p", help="Preset name (see 'feast-edge presets') or a .toml file.")]
ArchOpt = Annotated[
    str,
    typer.Option(
        "--arch",
        "-a",
        help='Architecture as JSON {"d":[..],"e":[..],"w":[..]} or text "d=[..] e=[..] w=[..]".',
    ),
]
ClassesOpt = Annotated[Optional[int], typer.Option("--classes", "-c", min=1, help="Classifier classes (default: the preset's).")]


def _millions(n: int) -> str:
    return f"{n / 1e6:,.2f}M"


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
            _millions(sum(x.macs for x in parts)),
            _millions(sum(x.params for x in parts)),
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
            "stem": {"channels": layout.stem_channels, "resolution": layout.stem_resolution, "macs": parts[0].macs, "params": parts[0].params},
            "stages": stages,
            "classifier": {"in_features": layout.last_channels, "classes": layout.classes, "macs": parts[-1].macs, "params": parts[-1].params},
        }
        typer.echo(json.dumps(record))
        return
    table = Table(title=f"{p.name}  {a}", caption=f"{layout.classes}-class head; MACs per example")
    for col in ("part", "blocks", "channels", "mid", "resolution", "MACs", "params"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for (part, blocks, channels, mid, res), cost in zip(layout.summary_rows(), parts):
        table.add_row(part, str(blocks), str(channels), str(mid or "-"), f"{res}x{res}", f"{cost.macs:,}", f"{cost.params:,}")
    table.add_row("classifier", "-", f"{layout.last_channels}->{layout.classes}", "-", "-", f"{parts[-1].macs:,}", f"{parts[-1].params:,}")
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
    from feast_edge.checkpoint import save_supernet
    from feast_edge.supernet import Supernet

    p = load_preset(preset)
    model = Supernet(p, classes=classes, seed=seed)
    save_supernet(out, model, seed=seed, round=0)
    console.print(f"wrote {out}: preset {p.name}, {model.classes} classes, {sum(t.numel() for t in model.parameters()):,} params", soft_wrap=True)


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", "-k", help="Supernet checkpoint (.safetensors).")],
    arch: ArchOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="ONNX file to write.")],
    preset: Annotated[Optional[str], typer.Option("--preset", "-p", help="Expected preset; refuse a checkpoint of another one.")] = None,
    calibration_data: Annotated[
        Optional[Path],
        typer.Option("--calibration-data", help="Fashion-MNIST directory for BN recalibration (SPEC §8)."),
    ] = None,
    calibration_samples: Annotated[int, typer.Option(min=1, help="Calibration samples (first N of the training split).")] = 500,
) -> None:
    """Extract one architecture from a checkpoint and write it as a self-describing ONNX file."""
    from feast_edge.atomic import check_writable
    from feast_edge.checkpoint import load_supernet

    expected = load_preset(preset) if preset is not None else None
    a = Arch.parse(arch)
    check_writable(out, "ONNX file")
    supernet, _ = load_supernet(checkpoint, expected)
    _export_variant(supernet, a.validated(supernet.preset), out, calibration_data, calibration_samples)


def _export_variant(supernet, arch: Arch, out: Path, calibration_data: Optional[Path], calibration_samples: int, extra: Optional[dict] = None) -> None:
    """Extract, optionally BN-recalibrate on Fashion-MNIST, and write one ONNX file."""
    from feast_edge.extract import extract, recalibrate_bn
    from feast_edge.onnx_export import export_onnx

    p = supernet.preset
    model = extract(supernet, arch)
    class_names = None
    if calibration_data is not None:
        from feast_edge.data import load_fashion_mnist, normalize

        if p.in_channels != 1 or p.input_size != 28:
            raise FeastError(f"--calibration-data reads Fashion-MNIST (1x28x28) but preset {p.name} takes {p.in_channels}x{p.input_size}x{p.input_size}; omit the flag")
        data = load_fashion_mnist(calibration_data, "train")
        class_names = data.classes
        pixels = normalize(data.floats(slice(0, calibration_samples)), p.mean, p.std)
        recalibrate_bn(model, pixels.split(100))
    fields = {"bn_recalibrated": calibration_data is not None, **(extra or {})}
    meta = export_onnx(model, out, p, arch, class_names=class_names, extra=fields)
    console.print(f"wrote {out}: {p.name} {arch}, {int(meta['feast.macs']):,} MACs, {int(meta['feast.params']):,} params", soft_wrap=True)


def _population_budgets(budgets: Optional[str], profiles: Optional[str], clients: int, preset: str) -> Optional[tuple[float, ...]]:
    """Explicit client budgets from ``--budgets`` or ``--profiles`` (None: Zipf)."""
    if budgets is not None and profiles is not None:
        raise FeastError("--budgets and --profiles both set the client budgets; pass one of them")
    if budgets is not None:
        return _cycled_budgets(budgets, clients)
    if profiles is not None:
        from feast_edge.profile import budgets_from_profiles

        return budgets_from_profiles(parse_list(profiles), clients, load_preset(preset))
    return None


def _cycled_budgets(text: str, clients: int) -> tuple[float, ...]:
    """``--budgets`` list, repeated in order until every client has one."""
    values = [parse_macs(t) for t in text.split(",") if t.strip()]
    if not values:
        raise FeastError("--budgets is empty; give at least one MAC budget, e.g. --budgets 2.79M,17.67M")
    return tuple(values[i % len(values)] for i in range(clients))


cache_app = typer.Typer(help="Build and inspect fixed variant caches (SPEC §3).", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


def _cache_table(cache, title: str) -> Table:
    table = Table(title=title)
    for col in ("#", "MACs", "params", "fitness", "rho", "target(s)", "arch"):
        table.add_column(col, justify="left" if col == "arch" else "right", no_wrap=col != "arch")
    for i, entry in enumerate(cache.entries):
        targets = ", ".join(_millions(int(job.target)) for job in entry.jobs)
        table.add_row(str(i), _millions(entry.macs), _millions(entry.params), f"{entry.fitness:.1f}", f"{entry.rho:.3f}", targets, str(entry.arch))
    return table


@cache_app.command("build")
def cache_build(
    preset: PresetOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="Cache JSON to write.")],
    targets: Annotated[Optional[str], typer.Option(help="Comma-separated MAC targets (e.g. 25M,50M); default: the preset's [cache] segments.")] = None,
    rho0: Annotated[Optional[float], typer.Option(help="Effectiveness ceiling for --targets (default: the preset's extraction ceilings).")] = None,
    seed: Annotated[int, typer.Option(help="Base seed; target k uses seed + k.")] = 42,
    population: Annotated[int, typer.Option(min=4, help="GA population per target.")] = 256,
    generations: Annotated[int, typer.Option(min=1, help="GA generations per target.")] = 512,
    workers: Annotated[int, typer.Option(min=1, help="Parallel worker processes.")] = 1,
) -> None:
    """Search the best architecture for every MAC target and write the cache (one GA per target)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from feast_edge.atomic import check_writable
    from feast_edge.cache import build_cache, cache_targets
    from feast_edge.search import extraction_rho0

    p = load_preset(preset)
    check_writable(out, "cache")
    jobs = None
    if targets is not None:
        values = [parse_macs(t) for t in targets.split(",") if t.strip()]
        if not values:
            raise FeastError("--targets is empty; give at least one MAC target, e.g. --targets 25M,50M")
        jobs = [(v, rho0 if rho0 is not None else extraction_rho0(p, v)) for v in values]
    with Progress(TextColumn("[bold]cache search"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("targets", total=len(jobs) if jobs is not None else len(cache_targets(p)))
        cache = build_cache(p, jobs, seed=seed, population=population, generations=generations, workers=workers, progress=lambda done, total, _r: bar.update(task, completed=done, total=total))
    cache.save(out)
    console.print(_cache_table(cache, f"{p.name}: {len(cache)} variants"))
    console.print(f"wrote {out}", soft_wrap=True)


@cache_app.command("show")
def cache_show(
    preset: PresetOpt,
    cache_file: Annotated[Optional[Path], typer.Option("--cache", help="Cache JSON (default: the one shipped for the preset).")] = None,
) -> None:
    """List a cache's variants: MACs, params, fitness, rho, arch."""
    from feast_edge.cache import load_cache

    p = load_preset(preset)
    cache = load_cache(p, cache_file)
    console.print(_cache_table(cache, f"{p.name}: {len(cache)} variants ({cache.classes}-class head)"))


@app.command("extract")
def extract_command(
    preset: PresetOpt,
    macs: Annotated[str, typer.Option("--macs", "-m", help="MAC budget, e.g. 30M or 3e7.")],
    checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", "-k", help="Trained supernet; with --out, export the found arch.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="ONNX file to write (needs --checkpoint).")] = None,
    calibration_data: Annotated[Optional[Path], typer.Option("--calibration-data", help="Fashion-MNIST directory for BN recalibration.")] = None,
    calibration_samples: Annotated[int, typer.Option(min=1, help="Calibration samples.")] = 500,
    seed: Annotated[int, typer.Option(help="GA seed.")] = 0,
    population: Annotated[int, typer.Option(min=4, help="GA population (paper: 512).")] = 512,
    generations: Annotated[int, typer.Option(min=1, help="GA generations (paper: 512).")] = 512,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Post-hoc extraction: the best (possibly uncached) arch under a MAC budget, served from trained weights."""
    from feast_edge.search import best_arch_under

    p = load_preset(preset)
    budget = parse_macs(macs)
    if out is not None and checkpoint is None:
        raise FeastError("--out needs --checkpoint (the trained supernet to extract the weights from)")
    if out is not None:
        from feast_edge.atomic import check_writable

        check_writable(out, "ONNX file")
    supernet = None
    if checkpoint is not None:
        from feast_edge.checkpoint import load_supernet

        supernet, _ = load_supernet(checkpoint, p)
    result = best_arch_under(p, budget, seed=seed, population=population, generations=generations)
    found_macs, found_params = arch_cost(p, result.arch)
    if as_json:
        typer.echo(json.dumps({"preset": p.name, "budget": budget, "arch": result.arch.to_dict(), "macs": found_macs, "params": found_params, "fitness": result.fitness.fitness, "rho": result.fitness.rho, "rho0": result.rho0}))
    else:
        console.print(f"best arch under {_millions(int(budget))} MACs: {result.arch}  ({found_macs:,} MACs, {found_params:,} params, fitness {result.fitness.fitness:.1f})", soft_wrap=True)
    if supernet is not None and out is not None:
        _export_variant(supernet, result.arch, out, calibration_data, calibration_samples, extra={"extracted_for_macs": budget})


@app.command()
def routing(
    preset: PresetOpt,
    cache_file: Annotated[Optional[Path], typer.Option("--cache", help="Cache JSON (default: the preset's shipped cache).")] = None,
    reference_csv: Annotated[Optional[Path], typer.Option("--reference-csv", help="Use the paper's published cache CSV instead.")] = None,
    clients: Annotated[int, typer.Option(help="Simulated clients N (Zipf budgets).")] = 100,
    zipf_s: Annotated[float, typer.Option(help="Zipf exponent of the budget ranks.")] = 1.2,
    seed: Annotated[int, typer.Option(help="Seed of the budget draw.")] = 0,
    budgets: Annotated[Optional[str], typer.Option(help="Comma-separated budgets to tabulate (e.g. 25M,50M,229M).")] = None,
    classes: ClassesOpt = None,
) -> None:
    """Routed envelope sizes and the communication report for a Zipf population (SPEC §5)."""
    import numpy as np

    from feast_edge.cache import load_cache, read_reference_csv
    from feast_edge.population import zipf_budgets
    from feast_edge.route import communication_report

    p = load_preset(preset)
    n_classes = p.classes if classes is None else classes
    cache = read_reference_csv(reference_csv, p) if reference_csv is not None else load_cache(p, cache_file)
    archs = sorted((arch_cost(p, e.arch, n_classes)[0], e.arch) for e in cache.entries)
    if archs and budgets is None:
        budgets = ",".join(str(m) for m in np.unique(np.quantile([m for m, _ in archs], [0, 0.25, 0.5, 0.75, 1.0]).astype(int)))
    table = Table(title=f"{p.name}: routed envelope per budget ({n_classes}-class head)")
    for col in ("budget", "affordable", "envelope params", "reduction"):
        table.add_column(col, justify="right")
    for text in (budgets or "").split(","):
        if not text.strip():
            continue
        b = parse_macs(text)
        affordable = [a for m, a in archs if m <= b]
        if not affordable:
            raise FeastError(f"budget {_millions(int(b))} MACs is below the smallest cached variant ({_millions(archs[0][0])}); raise it")
        report = communication_report(p, archs, [b], n_classes)
        table.add_row(_millions(int(b)), str(len(affordable)), _millions(report.payloads[0]), f"{report.aggregate_reduction:.1f}x")
    console.print(table)
    population = zipf_budgets(clients, np.random.default_rng(seed), s=zipf_s, b_min=p.budget_min, b_max=p.budget_max)
    report = communication_report(p, archs, population, n_classes)
    r = report.reductions
    console.print(
        f"{clients} clients, Zipf s={zipf_s}, budgets {_millions(p.budget_min)}..{_millions(p.budget_max)} MACs, seed {seed}:\n"
        f"  full supernet {_millions(report.full_params)} params; mean routed payload {_millions(int(report.mean_payload))} "
        f"-> aggregate reduction {report.aggregate_reduction:.2f}x\n"
        f"  per-client reduction: mean {sum(r) / len(r):.1f}x, median {report.median_reduction:.1f}x, max {max(r):.1f}x",
        soft_wrap=True,
    )


@app.command()
def simulate(
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory: checkpoints and results.")],
    preset: Annotated[str, typer.Option("--preset", "-p", help="Preset name or .toml file.")] = "fmnist-small",
    dataset: Annotated[str, typer.Option(help="fashion-mnist, cifar10, cifar100 (binary release) or imagefolder.")] = "fashion-mnist",
    data: Annotated[Path, typer.Option("--data", help="Local data directory (never downloaded).")] = Path("/usr/share/datasets/fashion-mnist"),
    clients: Annotated[int, typer.Option(help="Number of simulated clients N.")] = 20,
    per_round: Annotated[int, typer.Option(help="Clients sampled per round m.")] = 5,
    rounds: Annotated[int, typer.Option(help="Federation rounds (also the cosine-decay horizon).")] = 30,
    gamma: Annotated[float, typer.Option(help="Allocation exponent γ (0: data independent of budget, 1: proportional).")] = 1.0,
    zipf_s: Annotated[float, typer.Option(help="Zipf exponent of the budget ranks.")] = 1.2,
    alpha_eff: Annotated[float, typer.Option(help="Effective Dirichlet concentration α_eff.")] = 0.45,
    budget_min: Annotated[Optional[str], typer.Option(help="Smallest budget (MACs, e.g. 1.5M); default from the preset.")] = None,
    budget_max: Annotated[Optional[str], typer.Option(help="Largest budget (MACs); default from the preset.")] = None,
    budget_cap: Annotated[Optional[str], typer.Option(help="Allocation cap B_cap (MACs); default from the preset.")] = None,
    budgets: Annotated[Optional[str], typer.Option(help="Explicit client budgets instead of Zipf, comma-separated (e.g. a device-profile mix: 2.79M,6.6M,17.67M); cycled over --clients.")] = None,
    profiles: Annotated[Optional[str], typer.Option(help="Client budgets from device profiles instead of Zipf, comma-separated names in profiles/ or .json files; cycled over --clients.")] = None,
    method: Annotated[str, typer.Option(help="full, min, max, min+max or min+max+kd (the paper's ablations).")] = "full",
    seed: Annotated[int, typer.Option(help="Seed of every random choice.")] = 0,
    lr: Annotated[float, typer.Option(help="Initial SGD learning rate (cosine-decayed).")] = 0.025,
    batch_size: Annotated[int, typer.Option(help="Local batch size.")] = 64,
    eval_every: Annotated[int, typer.Option(help="Validate every k rounds.")] = 5,
    val_samples: Annotated[int, typer.Option(help="Server-held validation samples.")] = 5000,
    calib_samples: Annotated[int, typer.Option(help="Server-held BN-calibration samples.")] = 500,
    train_limit: Annotated[Optional[int], typer.Option(help="Use only this many training examples for clients.")] = None,
    test_limit: Annotated[Optional[int], typer.Option(help="Test on only the first N test examples.")] = None,
    cache: Annotated[Optional[Path], typer.Option(help="Variant cache JSON (default: the preset's shipped cache).")] = None,
    device: DeviceOpt = "auto",
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its last checkpoint.")] = False,
) -> None:
    """Run the paper's protocol in one process: population, rounds, evaluation, results."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from feast_edge.runtime import describe_device, resolve_device
    from feast_edge.simulate import Simulation, SimulationConfig

    requested, device = device, resolve_device(device)
    config = SimulationConfig(
        preset=preset,
        dataset=dataset,
        data_dir=str(data),
        clients=clients,
        per_round=per_round,
        rounds=rounds,
        gamma=gamma,
        zipf_s=zipf_s,
        alpha_eff=alpha_eff,
        budget_min=None if budget_min is None else parse_macs(budget_min),
        budget_max=None if budget_max is None else parse_macs(budget_max),
        budget_cap=None if budget_cap is None else parse_macs(budget_cap),
        budgets=_population_budgets(budgets, profiles, clients, preset),
        seed=seed,
        variants=method,
        lr=lr,
        batch_size=batch_size,
        eval_every=eval_every,
        val_samples=val_samples,
        calib_samples=calib_samples,
        train_limit=train_limit,
        test_limit=test_limit,
        cache=None if cache is None else str(cache),
        device=device,
    )
    config.train_config()  # validates --method and friends before any data is read
    sim = Simulation(config, out)
    console.print(str(sim.setup.population), soft_wrap=True)
    console.print(describe_device(device, requested), soft_wrap=True, highlight=False)
    columns = (
        TextColumn("[bold]round"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  best {task.fields[best]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    fmt = lambda v: "-" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("rounds", total=rounds, loss="-", val="-", best="-")

        def on_round(p) -> None:
            bar.update(task, completed=p.round, loss=f"{p.loss:.3f}", val=fmt(p.val_accuracy), best=fmt(p.best_val))

        testing = bar.add_task("test", total=None, visible=False, loss="", val="", best="")

        def on_test(done: int, total: int) -> None:
            bar.update(testing, completed=done, total=total, visible=True, description="testing variants")

        if resume:
            from feast_edge.checkpoint import read_record

            path = out / "checkpoint.safetensors"
            if path.is_file():
                bar.update(task, completed=read_record(path).get("fields", {}).get("round", 0))
        results = sim.run(resume=resume, on_round=on_round, on_test=on_test)
    table = Table(title=f"{config.preset}: per-variant test accuracy (best checkpoint, round {results['best'].get('round', '-')})")
    for col in ("#", "MACs", "params", "accuracy", "arch"):
        table.add_column(col, justify="left" if col == "arch" else "right")
    for v in results["variants"]:
        table.add_row(str(v["index"]), _millions(v["macs"]), _millions(v["params"]), f"{100 * v['test_accuracy']:.2f}%", str(Arch.from_dict(v["arch"])))
    console.print(table)
    comm = results["communication"]
    console.print(
        f"population accuracy (largest affordable variant per client): {100 * results['population_accuracy']:.2f}%\n"
        f"traffic: routed {comm['routed_params_total'] / 1e6:,.1f}M params vs full {comm['full_params_total'] / 1e6:,.1f}M "
        f"({comm['reduction']:.2f}x less); training compute {results['compute']['train_macs_total'] / 1e12:,.2f} TMAC\n"
        f"results: {out / 'results.json'}, {out / 'variants.csv'}, {out / 'rounds.csv'}",
        soft_wrap=True,
    )


@app.command()
def partition(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the shard files, server.safetensors and index.json.")],
    preset: Annotated[str, typer.Option("--preset", "-p", help="Preset name or .toml file.")] = "fmnist-small",
    dataset: Annotated[str, typer.Option(help="fashion-mnist, cifar10, cifar100 (binary release) or imagefolder.")] = "fashion-mnist",
    data: Annotated[Path, typer.Option("--data", help="Local data directory (never downloaded).")] = Path("/usr/share/datasets/fashion-mnist"),
    clients: Annotated[int, typer.Option(help="Number of clients N.")] = 20,
    budgets: Annotated[Optional[str], typer.Option(help="Explicit client budgets instead of Zipf, comma-separated (e.g. 2.79M,6.6M,17.67M); cycled over --clients, as in simulate.")] = None,
    gamma: Annotated[float, typer.Option(help="Allocation exponent γ.")] = 1.0,
    zipf_s: Annotated[float, typer.Option(help="Zipf exponent of the budget ranks.")] = 1.2,
    alpha_eff: Annotated[float, typer.Option(help="Effective Dirichlet concentration α_eff.")] = 0.45,
    budget_min: Annotated[Optional[str], typer.Option(help="Smallest Zipf budget (MACs); default from the preset.")] = None,
    budget_max: Annotated[Optional[str], typer.Option(help="Largest Zipf budget (MACs); default from the preset.")] = None,
    budget_cap: Annotated[Optional[str], typer.Option(help="Allocation cap B_cap (MACs); default from the preset.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the split, budgets and partition (as in simulate).")] = 0,
    val_samples: Annotated[int, typer.Option(help="Server-held validation samples.")] = 5000,
    calib_samples: Annotated[int, typer.Option(help="Server-held BN-calibration samples.")] = 500,
    train_limit: Annotated[Optional[int], typer.Option(help="Use only this many training examples for clients.")] = None,
    cache: Annotated[Optional[Path], typer.Option(help="Variant cache JSON (default: the preset's shipped cache).")] = None,
) -> None:
    """Write the simulator's client shards (one file per client) and server-held splits, for feast-agent --data."""
    from feast_edge.shards import write_partition
    from feast_edge.simulate import SimulationConfig

    config = SimulationConfig(
        preset=preset,
        dataset=dataset,
        data_dir=str(data),
        clients=clients,
        per_round=1,
        gamma=gamma,
        zipf_s=zipf_s,
        alpha_eff=alpha_eff,
        budget_min=None if budget_min is None else parse_macs(budget_min),
        budget_max=None if budget_max is None else parse_macs(budget_max),
        budget_cap=None if budget_cap is None else parse_macs(budget_cap),
        budgets=None if budgets is None else _cycled_budgets(budgets, clients),
        seed=seed,
        val_samples=val_samples,
        calib_samples=calib_samples,
        train_limit=train_limit,
        cache=None if cache is None else str(cache),
    )
    index = write_partition(config, out)
    table = Table(title=f"{index['preset']}: {len(index['clients'])} client shards in {out}")
    for col in ("client", "budget", "samples", "file"):
        table.add_column(col, justify="right" if col in ("budget", "samples") else "left")
    for c in index["clients"]:
        table.add_row(c["client_id"], _millions(int(c["budget_macs"])), str(c["samples"]), c["file"])
    console.print(table)
    server = index["server"]
    console.print(f"server-held: {server['validation']} validation + {server['calibration']} calibration examples in {out / server['file']}", soft_wrap=True)


@app.command()
def demo(
    broker: Annotated[Optional[str], typer.Option(help="Use this MQTT broker (mqtt://host:port) instead of starting one on a free loopback port.")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Federation rounds.")] = 3,
    samples: Annotated[int, typer.Option(min=50, help="Training examples per device on average (split by budget, SPEC §4 γ = 1).")] = 800,
    profiles: Annotated[str, typer.Option(help="Comma-separated device profiles (names in profiles/ or files), one agent each.")] = "raspberry-pi-5,jetson-nano,laptop-cpu,desktop-gpu",
    data: Annotated[Path, typer.Option("--data", help="Fashion-MNIST directory.")] = Path("/usr/share/datasets/fashion-mnist"),
    out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (its partition/, server/, device-models/, logs/ are replaced).")] = Path("feast-demo"),
    seed: Annotated[int, typer.Option(help="Seed of the partition and the federation.")] = 0,
    embedded_broker: Annotated[str, typer.Option("--embedded-broker", help="Without --broker: auto (mosquitto if installed, else amqtt), mosquitto or amqtt.")] = "auto",
) -> None:
    """One command end to end: broker, feast-server and one feast-agent per device profile, rounds, ONNX per device."""
    from feast_edge.server.demo import run_demo

    run_demo(
        broker=broker, rounds=rounds, samples=samples, profiles=parse_list(profiles), data=data, out=out,
        seed=seed, console=console, embedded_broker=embedded_broker,
    )


def main() -> None:
    """Console-script entry of ``feast-edge``."""
    run_cli(app)


if __name__ == "__main__":
    main()
