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
from rich.console import Console
from rich.table import Table

from feast_edge.arch import Arch
from feast_edge.cost import cost_breakdown
from feast_edge.errors import FeastError
from feast_edge.geometry import arch_layout, supernet_layout
from feast_edge.preset import BUILTIN_DIR, available_presets, load_preset

app = typer.Typer(
    name="feast-edge",
    help="Federated shared-space training (FEAST): one elastic network, a model for every device.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()

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
    from feast_edge.extract import extract, recalibrate_bn
    from feast_edge.onnx_export import export_onnx

    expected = load_preset(preset) if preset is not None else None
    a = Arch.parse(arch)
    check_writable(out, "ONNX file")
    supernet, _ = load_supernet(checkpoint, expected)
    p = supernet.preset
    a = a.validated(p)
    model = extract(supernet, a)
    class_names = None
    if calibration_data is not None:
        from feast_edge.data import load_fashion_mnist, normalize

        if p.in_channels != 1 or p.input_size != 28:
            raise FeastError(f"--calibration-data reads Fashion-MNIST (1x28x28) but preset {p.name} takes {p.in_channels}x{p.input_size}x{p.input_size}; omit the flag")
        data = load_fashion_mnist(calibration_data, "train")
        class_names = data.classes
        pixels = normalize(data.floats(slice(0, calibration_samples)), p.mean, p.std)
        recalibrate_bn(model, pixels.split(100))
    meta = export_onnx(model, out, p, a, class_names=class_names, extra={"bn_recalibrated": calibration_data is not None})
    console.print(f"wrote {out}: {p.name} {a}, {int(meta['feast.macs']):,} MACs, {int(meta['feast.params']):,} params", soft_wrap=True)


def main() -> None:
    """Console-script entry: run the app, turning user errors into one line and exit status 2."""
    try:
        app()
    except FeastError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
