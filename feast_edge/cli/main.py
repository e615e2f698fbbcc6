"""``feast-edge`` command line: inspect presets and architectures, create and export models; the run commands are in ``runs``.

User errors (bad preset, arch, path, checkpoint) print one ``error:`` line to
stderr and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from feast_edge.cli import common
from feast_edge.cli.common import make_app, make_console, millions, parse_macs, run_cli
from feast_edge.cli.dashboard import register as register_dashboard
from feast_edge.cli.preset import register as register_preset
from feast_edge.cli.report import register as register_report
from feast_edge.cli.runs import register as register_runs
from feast_edge.errors import FeastError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost, cost_breakdown
from feast_edge.space.geometry import arch_layout, supernet_layout
from feast_edge.space.preset import BUILTIN_DIR, available_presets, load_preset

app = make_app("feast-edge", "Federated shared-space training (FEAST): one elastic network, a model for every device.")
console = make_console()

PresetOpt = Annotated[
    str, typer.Option("--preset", "-p", help="Preset name (see 'feast-edge presets') or a .toml file.")
]
ArchOpt = Annotated[
    str,
    typer.Option(
        "--arch",
        "-a",
        help='Architecture as JSON {"d":[..],"e":[..],"w":[..]} or text "d=[..] e=[..] w=[..]".',
    ),
]
ClassesOpt = Annotated[
    Optional[int], typer.Option("--classes", "-c", min=1, help="Classifier classes (default: the preset's).")
]


PrecisionOpt = Annotated[
    str,
    typer.Option(
        "--precision",
        help="fp32, or int8: onnxruntime static quantization (QDQ, per-channel int8 weights) calibrated on "
        "--calibration-data, kept only within --int8-tolerance of float32 on Fashion-MNIST's test split.",
    ),
]
Int8CheckOpt = Annotated[
    int, typer.Option("--int8-check", min=1, help="Test-split images the int8 file is checked on against float32.")
]
Int8FormOpt = Annotated[
    str,
    typer.Option(
        "--int8-form",
        help="onnxruntime (uint8 activations: onnxruntime's fast CPU form) or tensorrt (symmetric int8 activations, "
        "zero points 0: what TensorRT's explicit quantization builds, e.g. trtexec on a Jetson).",
    ),
]
DEFAULT_INT8_SAMPLES, DEFAULT_INT8_CHECK, DEFAULT_INT8_TOLERANCE = 256, 1000, 0.01


@dataclass(frozen=True)
class Int8Options:
    """What --precision int8 asks of an export (None from :meth:`parse` for float32)."""

    data: Path
    samples: int
    check: int
    tolerance: float
    form: str = "onnxruntime"

    @classmethod
    def parse(
        cls, precision: str, data: Path | None, samples: int, check: int, tolerance: float, form: str = "onnxruntime"
    ) -> Int8Options | None:
        """The int8 options, checked before anything is loaded; None for --precision fp32."""
        from feast_edge.evaluate.precisions import FORMS
        from feast_edge.evaluate.quantize import check_precision

        if form not in FORMS:
            raise FeastError(f"--int8-form {form!r} is unknown; choose {' or '.join(FORMS)}")
        if not 0 <= tolerance <= 1:
            raise FeastError(f"--int8-tolerance {tolerance:g} must be a fraction in [0, 1] (0.01 = 1 point)")
        if check_precision(precision) == "fp32":
            return None
        if data is None:
            raise FeastError(
                "--precision int8 calibrates on images: give --calibration-data (the Fashion-MNIST directory), "
                "or export with --precision fp32"
            )
        return cls(data, samples, check, tolerance, form)


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


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", "-k", help="Supernet checkpoint (.safetensors).")],
    arch: ArchOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="ONNX file to write.")],
    preset: Annotated[
        Optional[str], typer.Option("--preset", "-p", help="Expected preset; refuse a checkpoint of another one.")
    ] = None,
    calibration_data: Annotated[
        Optional[Path],
        typer.Option("--calibration-data", help="Fashion-MNIST directory for BN recalibration (SPEC §8)."),
    ] = None,
    calibration_samples: Annotated[
        int, typer.Option(min=1, help="Calibration samples (first N of the training split).")
    ] = 500,
    precision: PrecisionOpt = "fp32",
    int8_samples: common.Int8SamplesOpt = DEFAULT_INT8_SAMPLES,
    int8_check: Int8CheckOpt = DEFAULT_INT8_CHECK,
    int8_tolerance: common.Int8ToleranceOpt = DEFAULT_INT8_TOLERANCE,
    int8_form: Int8FormOpt = "onnxruntime",
) -> None:
    """Extract one architecture from a checkpoint and write it as a self-describing ONNX file (float32 or int8)."""
    from feast_edge.run.checkpoint import load_supernet
    from feast_edge.util.atomic import check_writable

    expected = load_preset(preset) if preset is not None else None
    a = Arch.parse(arch)
    quantized = Int8Options.parse(precision, calibration_data, int8_samples, int8_check, int8_tolerance, int8_form)
    check_writable(out, "ONNX file")
    supernet, _ = load_supernet(checkpoint, expected)
    _export_variant(supernet, a.validated(supernet.preset), out, calibration_data, calibration_samples, quantized)


def _export_variant(
    supernet,
    arch: Arch,
    out: Path,
    calibration_data: Optional[Path],
    calibration_samples: int,
    int8: Int8Options | None = None,
    extra: Optional[dict] = None,
) -> None:
    """Extract, optionally BN-recalibrate on Fashion-MNIST, and write one ONNX file (then its int8 twin in its place)."""
    from feast_edge.evaluate.onnx_export import export_onnx, read_metadata
    from feast_edge.space.extract import extract, recalibrate_bn

    p = supernet.preset
    model = extract(supernet, arch)
    class_names = None
    if calibration_data is not None:
        from feast_edge.data.images import load_fashion_mnist, normalize

        if p.in_channels != 1 or p.input_size != 28:
            raise FeastError(
                f"--calibration-data reads Fashion-MNIST (1x28x28) but preset {p.name} takes {p.in_channels}x{p.input_size}x{p.input_size}; omit the flag"
            )
        data = load_fashion_mnist(calibration_data, "train")
        class_names = data.classes
        pixels = normalize(data.floats(slice(0, calibration_samples)), p.mean, p.std)
        recalibrate_bn(model, pixels.split(100))
    fields = {"bn_recalibrated": calibration_data is not None, **(extra or {})}
    meta = export_onnx(model, out, p, arch, class_names=class_names, extra=fields)
    if int8 is not None:
        _quantize_in_place(out, int8, p)
        meta = {f"feast.{k}": v for k, v in read_metadata(out).items()}
    console.print(
        f"wrote {out}: {p.name} {arch}, {int(meta['feast.macs']):,} MACs, {int(meta['feast.params']):,} params, "
        f"{meta.get('feast.precision', 'fp32')}",
        soft_wrap=True,
    )


def _quantize_in_place(out: Path, int8: Int8Options, preset) -> None:
    """Replace the float32 file ``out`` by its int8 twin; on refusal keep the float32 file and say so (exit 2)."""
    from feast_edge.data.images import load_fashion_mnist
    from feast_edge.evaluate.quantize import QuantizationError, quantize_int8

    train, test = load_fashion_mnist(int8.data, "train"), load_fashion_mnist(int8.data, "test")
    check = slice(0, min(int8.check, len(test.labels)))
    try:
        _, result = quantize_int8(
            out,
            out,
            train.floats(slice(0, int8.samples)).numpy(),
            test.floats(check).numpy(),
            test.labels[check].numpy(),
            origin=f"Fashion-MNIST train split ({int8.data}), first images",
            task_digest=preset.task.digest,
            tolerance=int8.tolerance,
            form=int8.form,
        )
    except QuantizationError as exc:
        raise FeastError(f"{exc}; kept the float32 model in {out}") from None
    console.print(f"int8: {result.describe()}", soft_wrap=True)


cache_app = typer.Typer(help="Build and inspect fixed variant caches (SPEC §3).", no_args_is_help=True)
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
        Optional[Path],
        typer.Option(
            "--out", "-o", help="Cache JSON to write (default for a preset file my.toml: my.cache.json beside it)."
        ),
    ] = None,
    targets: Annotated[
        Optional[str],
        typer.Option(help="Comma-separated MAC targets (e.g. 25M,50M); default: the preset's [cache] segments."),
    ] = None,
    rho0: Annotated[
        Optional[float],
        typer.Option(help="Effectiveness ceiling for --targets (default: the preset's extraction ceilings)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Base seed; target k uses seed + k.")] = 42,
    population: Annotated[int, typer.Option(min=4, help="GA population per target.")] = 256,
    generations: Annotated[int, typer.Option(min=1, help="GA generations per target.")] = 512,
    workers: Annotated[int, typer.Option(min=1, help="Parallel worker processes.")] = 1,
) -> None:
    """Search the best architecture for every MAC target and write the cache (one GA per target)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from feast_edge.cache.search import extraction_rho0
    from feast_edge.cache.variants import build_cache, cache_targets, user_cache_path
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
        Optional[Path],
        typer.Option("--cache", help="Cache JSON (default: the one beside the preset's file, else the shipped one)."),
    ] = None,
) -> None:
    """List a cache's variants: MACs, params, fitness, rho, arch."""
    from feast_edge.cache.variants import load_cache

    p = load_preset(preset)
    cache = load_cache(p, cache_file)
    console.print(_cache_table(cache, f"{p.name}: {len(cache)} variants ({cache.classes}-class head)"))


@app.command("extract")
def extract_command(
    preset: PresetOpt,
    macs: Annotated[str, typer.Option("--macs", "-m", help="MAC budget, e.g. 30M or 3e7.")],
    checkpoint: Annotated[
        Optional[Path], typer.Option("--checkpoint", "-k", help="Trained supernet; with --out, export the found arch.")
    ] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="ONNX file to write (needs --checkpoint).")] = None,
    calibration_data: Annotated[
        Optional[Path], typer.Option("--calibration-data", help="Fashion-MNIST directory for BN recalibration.")
    ] = None,
    calibration_samples: Annotated[int, typer.Option(min=1, help="Calibration samples.")] = 500,
    precision: PrecisionOpt = "fp32",
    int8_samples: common.Int8SamplesOpt = DEFAULT_INT8_SAMPLES,
    int8_check: Int8CheckOpt = DEFAULT_INT8_CHECK,
    int8_tolerance: common.Int8ToleranceOpt = DEFAULT_INT8_TOLERANCE,
    int8_form: Int8FormOpt = "onnxruntime",
    seed: Annotated[int, typer.Option(help="GA seed.")] = 0,
    population: Annotated[int, typer.Option(min=4, help="GA population (paper: 512).")] = 512,
    generations: Annotated[int, typer.Option(min=1, help="GA generations (paper: 512).")] = 512,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Post-hoc extraction: the best (possibly uncached) arch under a MAC budget, served from trained weights."""
    from feast_edge.cache.search import best_arch_under

    p = load_preset(preset)
    budget = parse_macs(macs)
    if out is not None and checkpoint is None:
        raise FeastError("--out needs --checkpoint (the trained supernet to extract the weights from)")
    quantized = Int8Options.parse(precision, calibration_data, int8_samples, int8_check, int8_tolerance, int8_form)
    if out is not None:
        from feast_edge.util.atomic import check_writable

        check_writable(out, "ONNX file")
    supernet = None
    if checkpoint is not None:
        from feast_edge.run.checkpoint import load_supernet

        supernet, _ = load_supernet(checkpoint, p)
    result = best_arch_under(p, budget, seed=seed, population=population, generations=generations)
    found_macs, found_params = arch_cost(p, result.arch)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "preset": p.name,
                    "budget": budget,
                    "arch": result.arch.to_dict(),
                    "macs": found_macs,
                    "params": found_params,
                    "fitness": result.fitness.fitness,
                    "rho": result.fitness.rho,
                    "rho0": result.rho0,
                }
            )
        )
    else:
        console.print(
            f"best arch under {millions(int(budget))} MACs: {result.arch}  ({found_macs:,} MACs, {found_params:,} params, fitness {result.fitness.fitness:.1f})",
            soft_wrap=True,
        )
    if supernet is not None and out is not None:
        _export_variant(
            supernet,
            result.arch,
            out,
            calibration_data,
            calibration_samples,
            quantized,
            extra={"extracted_for_macs": budget},
        )


register_runs(app)
register_report(app)
register_dashboard(app)
register_preset(app)


def main() -> None:
    """Console-script entry of ``feast-edge``."""
    run_cli(app)


if __name__ == "__main__":
    main()
