"""``feast-edge export`` and ``feast-edge extract``: one variant of a trained supernet as an ONNX file, float32 or int8."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from feast_edge.cli import common
from feast_edge.cli.common import ArchOpt, PresetOpt, make_console, millions, parse_macs
from feast_edge.errors import FeastError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.preset import load_preset

console = make_console()


def register(app: typer.Typer) -> None:
    """Add ``export`` and ``extract`` to the ``feast-edge`` app."""
    app.command("export")(export)
    app.command("extract")(extract_command)


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


def export(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", "-k", help="Supernet checkpoint (.safetensors).")],
    arch: ArchOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="ONNX file to write.")],
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Expected preset; refuse a checkpoint of another one.")
    ] = None,
    calibration_data: Annotated[
        Path | None,
        typer.Option("--calibration-data", help="Fashion-MNIST directory for BN recalibration (method §8)."),
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
    calibration_data: Path | None,
    calibration_samples: int,
    int8: Int8Options | None = None,
    extra: dict | None = None,
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


def extract_command(
    preset: PresetOpt,
    macs: Annotated[str, typer.Option("--macs", "-m", help="MAC budget, e.g. 30M or 3e7.")],
    checkpoint: Annotated[
        Path | None, typer.Option("--checkpoint", "-k", help="Trained supernet; with --out, export the found arch.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="ONNX file to write (needs --checkpoint).")] = None,
    calibration_data: Annotated[
        Path | None, typer.Option("--calibration-data", help="Fashion-MNIST directory for BN recalibration.")
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
