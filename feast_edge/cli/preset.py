"""``feast-edge preset new``: write a preset for your own images from their shape, class names and device budgets."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from feast_edge.cli.common import make_console, millions, parse_list, parse_macs
from feast_edge.data.task import RESIZE_POLICIES
from feast_edge.errors import FeastError

console = make_console()
preset_app = typer.Typer(help="Write presets for your own input (docs/presets.md).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``preset new`` to the ``feast-edge`` app."""
    app.add_typer(preset_app, name="preset")


def parse_input(text: str) -> tuple[int, int]:
    """``CxHxW`` (square, C = 1 or 3) as ``(channels, size)``."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if match is None:
        raise FeastError(f"--input {text!r} is not CxHxW; write e.g. 3x64x64 (RGB, 64x64) or 1x28x28 (grey)")
    channels, height, width = (int(v) for v in match.groups())
    if channels not in (1, 3):
        raise FeastError(f"--input {text}: {channels} channels; a task takes 1 (grey) or 3 (RGB)")
    if height != width or height < 1:
        raise FeastError(
            f"--input {text}: the model takes square images; give HxH (e.g. {channels}x{max(height, width)}x{max(height, width)}) "
            "and choose --resize for images of other shapes"
        )
    return channels, height


def parse_range(text: str) -> tuple[float, float]:
    """``LOW..HIGH`` MACs (``2M..200M``) as floats."""
    parts = text.split("..")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise FeastError(f"--budgets {text!r} is not LOW..HIGH; write e.g. 2M..200M (MACs per image)")
    low, high = (parse_macs(p) for p in parts)
    if not low < high:
        raise FeastError(
            f"--budgets {text}: the range is inverted or empty; give LOW..HIGH with LOW < HIGH, e.g. 2M..200M"
        )
    return low, high


def _floats(text: str | None, channels: int, flag: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in parse_list(text))
    except ValueError:
        raise FeastError(f"{flag} {text!r}: write {channels} comma-separated numbers, e.g. 0.5,0.5,0.5") from None
    if len(values) == 1 and channels > 1:
        values = values * channels
    if len(values) != channels:
        raise FeastError(f"{flag} {text!r} has {len(values)} values; give one per channel ({channels}) or one for all")
    return values


def count_images(folder: Path, names: tuple[str, ...]) -> int:
    """Image files (by suffix, undecoded) under ``folder/<class>/`` for every class in ``names``."""
    from feast_edge.data.folder_stats import IMAGE_SUFFIXES

    return sum(
        f.lower().endswith(IMAGE_SUFFIXES) for name in names for _, _, files in os.walk(folder / name) for f in files
    )


@preset_app.command("new")
def new(
    input_shape: Annotated[str, typer.Option("--input", help="Input shape CxHxW, e.g. 3x64x64 (C: 1 grey or 3 RGB).")],
    budgets: Annotated[
        str, typer.Option("--budgets", help="Device budget range LOW..HIGH in MACs per image, e.g. 2M..200M.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Preset file to write (.toml).")],
    classes: Annotated[
        str | None, typer.Option("--classes", help="Class names in output order, comma-separated: cat,dog,bird.")
    ] = None,
    classes_from: Annotated[
        Path | None,
        typer.Option(
            "--classes-from",
            help="Image folder DIR/<class>/ (or DIR/train/<class>/): its sorted sub-folder names are the classes, "
            "and mean/std are measured on a sample of its images.",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Preset name (default: the file name of --out).")] = None,
    description: Annotated[str | None, typer.Option("--description", help="One line describing the task.")] = None,
    mean: Annotated[
        str | None, typer.Option("--mean", help="Per-channel mean of pixels in [0, 1], e.g. 0.49,0.48,0.45.")
    ] = None,
    std: Annotated[str | None, typer.Option("--std", help="Per-channel std of pixels in [0, 1].")] = None,
    resize: Annotated[
        str,
        typer.Option("--resize", help=f"How images of another size are brought to HxH: {', '.join(RESIZE_POLICIES)}."),
    ] = "stretch",
    stats_images: Annotated[
        int, typer.Option("--stats-images", min=1, help="With --classes-from: images sampled for mean/std.")
    ] = 500,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
) -> None:
    """Design a supernet family, cache targets and client budgets for your input and write them as a preset."""
    from feast_edge.cache.design import design_preset
    from feast_edge.cache.design_toml import preset_toml
    from feast_edge.data.task import Task, check_class_name
    from feast_edge.space.preset import load_preset_file
    from feast_edge.util.atomic import atomic_write_bytes, check_writable

    channels, size = parse_input(input_shape)
    low, high = parse_range(budgets)
    if resize not in RESIZE_POLICIES:
        raise FeastError(f"--resize {resize!r} is unknown; choose one of {', '.join(RESIZE_POLICIES)}")
    if classes is not None and classes_from is not None:
        raise FeastError(
            "--classes and --classes-from were both given; give the classes once: --classes a,b,c or "
            "--classes-from DIR (an image folder)"
        )
    if classes is None and classes_from is None:
        raise FeastError("give the classes once: --classes a,b,c or --classes-from DIR (an image folder)")
    if out.suffix != ".toml":
        raise FeastError(f"--out {out}: a preset file ends in .toml; write e.g. --out {out.with_suffix('.toml').name}")
    if out.exists() and not force:
        raise FeastError(f"--out {out} exists; choose another file or pass --force to overwrite it")
    check_writable(out, "preset file")
    name = out.stem if name is None else name
    if not name or name.strip() != name or "/" in name or "\\" in name:
        raise FeastError(f"--name {name!r} must be a non-empty name without spaces around it or slashes")
    folder, stats_note, images = None, "", None
    if classes_from is not None:
        from feast_edge.data.folder_stats import class_folders

        folder, names = class_folders(classes_from)
        images = count_images(folder, names)
    else:
        names = tuple(parse_list(classes))
        if not names:
            raise FeastError("--classes is empty; give the class names, e.g. --classes cat,dog,bird")
        for n in names:
            check_class_name(n, "--classes")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise FeastError(f"--classes names {', '.join(twice)} more than once; class names must be unique")
    mean_v, std_v = _floats(mean, channels, "--mean"), _floats(std, channels, "--std")
    if folder is not None and (mean_v is None or std_v is None):
        from feast_edge.data.folder_stats import pixel_stats

        task = Task(channels, size, names, (0.5,) * channels, (0.25,) * channels, resize)
        measured_mean, measured_std, read = pixel_stats(folder, task, stats_images)
        mean_v, std_v = mean_v or measured_mean, std_v or measured_std
        stats_note = (
            f"Measured on {read} images of {folder} (sampled evenly over the classes, {resize} to {size}x{size})."
        )
    elif mean_v is not None or std_v is not None:
        stats_note = "Given with --mean / --std (one not given is the placeholder: 0.5 for mean, 0.25 for std)."
    with console.status("designing the supernet family and checking its cache targets"):
        design = design_preset(
            name, channels, size, names, low, high, mean_v, std_v, resize, description, stats_note, images
        )
    text = preset_toml(design)
    atomic_write_bytes(out, text.encode())
    written = load_preset_file(out)  # what the user's file says, read back
    if written != design.preset:
        raise FeastError(f"internal check failed: {out} does not read back as the designed preset; report this")
    _print(design, out)


def _print(design, out: Path) -> None:
    p = design.preset
    table = Table(
        title=f"preset {p.name}: {p.in_channels}x{p.input_size}x{p.input_size}, {p.classes} classes", show_header=False
    )
    table.add_column("", justify="left")
    table.add_column("", justify="left")
    raised = "" if design.short_scale is None else f" (raised from {design.short_scale:.2f}: top unreachable there)"
    table.add_row("family", f"{design.shape.preset}'s shape x {design.scale:.2f}{raised}, divisor {p.divisor}")
    table.add_row("stem", f"{p.stem_channels} channels, stride {p.stem_stride}")
    table.add_row("stages", f"channels {list(p.stage_channels)}, strides {list(p.stage_strides)}")
    table.add_row("choices", f"up to {p.max_extra_blocks} extra blocks, expansion {list(p.expansion_ratios)}")
    table.add_row(
        "MAC range",
        f"{millions(design.smallest_macs)} .. {millions(design.largest_macs)} (full: {design.largest_params:,} params)",
    )
    for seg in p.cache_segments:
        table.add_row(
            f"cache {seg.name}",
            f"{seg.count} targets {millions(seg.start)} .. {millions(seg.stop)}, rho0 {seg.rho0:.2f}",
        )
    table.add_row("top target", f"{millions(design.high)} finds a {millions(design.top_macs)} network")
    table.add_row(
        "population",
        f"Zipf {millions(p.budget_min)} .. {millions(p.budget_max)}, cap {millions(p.budget_cap)}",
    )
    table.add_row("mean / std", f"{[round(v, 4) for v in p.mean]} / {[round(v, 4) for v in p.std]}")
    measured = "images not counted" if design.images is None else f"{design.images:,} images"
    table.add_row("recipe", ", ".join(f"{k} {v}" for k, v in p.train) + f" ({measured})")
    console.print(table)
    console.print(f"wrote {out}", soft_wrap=True, highlight=False)
    console.print(
        f"next: feast-edge cache build --preset {out}   (writes {out.with_name(out.stem + '.cache.json')})",
        soft_wrap=True,
        highlight=False,
    )
