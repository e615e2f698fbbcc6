"""int8 ONNX files: onnxruntime static quantization of an exported variant, checked against its float32 twin.

The form is QDQ (QuantizeLinear/DequantizeLinear pairs around Conv and Gemm)
with per-channel signed int8 weights and activation ranges (MinMax) from
calibration images. Two forms (``FORMS``): ``onnxruntime`` (the default, what
devices are served) has unsigned int8 activations with a zero point, the
fastest form of onnxruntime's CPU kernels on x86 without VNNI (measured:
symmetric int8 activations ran 2.3x slower there and agreed less with float32);
``tensorrt`` has symmetric signed int8 activations and weights (zero points 0),
the only form TensorRT's explicit quantization builds. The graph
still takes pixels in [0, 1] and normalizes them itself, and it keeps every
``feast.*`` entry of the float32 file, plus ``feast.precision`` and where the
calibration images came from.

A quantized file is kept only when it loads in onnxruntime and loses at most
``tolerance`` accuracy against its float32 twin on labelled held-out images
(top-1 agreement is recorded beside it); otherwise :class:`QuantizationError`
says why and the caller keeps the float32 file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from feast_edge.errors import FeastError
from feast_edge.evaluate.onnx_export import INPUT_NAME, OUTPUT_NAME, onnx_session, read_metadata
from feast_edge.evaluate.precisions import FORMS, PRECISIONS
from feast_edge.util.atomic import atomic_write_bytes

DEFAULT_TOLERANCE = 0.01  # accuracy (a fraction: 1 point) an int8 file may lose against its float32 twin
DEFAULT_CALIBRATION = 256  # images whose activations set the int8 ranges
MIN_CHECK = 20  # held-out images the accuracy check needs at the least (fewer cannot resolve 1 point at all)
BATCH = 64  # images per onnxruntime run, calibrating and checking


class QuantizationError(FeastError):
    """An int8 file cannot be made or is not good enough; the float32 file stays what is served."""


def check_precision(precision: str, option: str = "--precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a QuantizationError naming them."""
    if precision not in PRECISIONS:
        raise QuantizationError(
            f"{option} {precision!r} is unknown; choose fp32 (float32) or int8 (onnxruntime static quantization)"
        )
    return precision


@dataclass(frozen=True)
class Int8Check:
    """The int8 file against its float32 twin on the same held-out images."""

    samples: int
    fp32_accuracy: float
    int8_accuracy: float
    agreement: float  # share of images on which both predict the same class

    @property
    def loss(self) -> float:
        return self.fp32_accuracy - self.int8_accuracy

    def describe(self) -> str:
        return (
            f"int8 {100 * self.int8_accuracy:.2f} % vs float32 {100 * self.fp32_accuracy:.2f} % on {self.samples} "
            f"held-out images, same class on {100 * self.agreement:.2f} %"
        )


def _input_shape(meta: dict[str, str], where: str) -> tuple[int, int, int]:
    try:
        channels, height, width = json.loads(meta["input_shape"])
        return int(channels), int(height), int(width)
    except (KeyError, ValueError, TypeError):
        raise QuantizationError(
            f"{where} has no readable feast.input_shape; export it with this version of feast-edge first"
        ) from None


def _check_images(images: np.ndarray, shape: tuple[int, int, int], what: str, fix: str) -> np.ndarray:
    """``images`` (uint8 or float32 in [0, 1]) as float32 [N, C, H, W] of the model's input shape, else a QuantizationError."""
    images = np.asarray(images)
    if images.dtype == np.uint8:
        images = images.astype(np.float32) / np.float32(255.0)
    if images.ndim != 4 or tuple(images.shape[1:]) != shape:
        raise QuantizationError(
            f"the {what} are {'x'.join(map(str, images.shape[1:])) or 'scalars'} per image, the model takes "
            f"{'x'.join(map(str, shape))}; {fix}"
        )
    if images.shape[0] == 0:
        raise QuantizationError(f"the {what} are empty; {fix}")
    images = images.astype(np.float32, copy=False)
    if not np.isfinite(images).all() or images.min() < 0.0 or images.max() > 1.0:
        raise QuantizationError(f"the {what} must be pixels in [0, 1] (finite); {fix}")
    return images


def _batches(images: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, images.shape[0], BATCH):
        yield np.ascontiguousarray(images[start : start + BATCH])


def predictions(path: str | os.PathLike[str], images: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Top-1 class of every image (float32 [N, C, H, W] in [0, 1]) under the ONNX file at ``path``."""
    session = onnx_session(path, threads=threads)
    return np.concatenate(
        [session.run([OUTPUT_NAME], {INPUT_NAME: batch})[0].argmax(axis=1) for batch in _batches(images)]
    )


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over an array of images, in batches."""

    def __init__(self, images: np.ndarray) -> None:
        self._batches = _batches(images)

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch}


def _quantized_bytes(fp32: Path, calibration: np.ndarray, workdir: Path, form: str = "onnxruntime") -> bytes:
    """onnxruntime's static quantization of ``fp32`` (QDQ, per-channel int8 weights, MinMax) in ``form``."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quant_pre_process, quantize_static

    prepared, out = workdir / "prepared.onnx", workdir / "int8.onnx"
    try:
        # Shape inference and onnxruntime's graph optimizations first (BatchNormalization folded into Conv), so the
        # per-channel weight scales are those of the weights that run and every activation has a range.
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared),
            str(out),
            _Reader(calibration),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8 if form == "onnxruntime" else QuantType.QInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            op_types_to_quantize=["Conv", "Gemm", "MatMul", "Add", "Relu", "GlobalAveragePool"],
            extra_options={} if form == "onnxruntime" else {"ActivationSymmetric": True, "WeightSymmetric": True},
        )
    except Exception as exc:  # noqa: BLE001 - onnxruntime's quantizer raises many types on a graph it cannot handle
        raise QuantizationError(
            f"onnxruntime could not quantize the model ({type(exc).__name__}: {exc}); serve it in float32 (--precision fp32)"
        ) from None
    return out.read_bytes()


def quantize_int8(
    fp32_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    calibration: np.ndarray,
    check_images: np.ndarray,
    check_labels: np.ndarray,
    *,
    origin: str,
    task_digest: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    form: str = "onnxruntime",
    threads: int | None = None,
) -> tuple[dict[str, str], Int8Check]:
    """Write the int8 twin of the exported float32 file ``fp32_path`` to ``out``; its metadata and its check.

    ``calibration``: pixels [N, C, H, W] (uint8, or float32 in [0, 1]) that set the activation ranges; ``check_images`` and
    ``check_labels``: held-out images the int8 file must classify within ``tolerance`` of the float32 one;
    ``origin``: where the images came from (recorded); ``task_digest``: the task the images were checked
    against, refused when it is not the model's; ``form``: one of :data:`FORMS`; ``threads``: onnxruntime's intra-op
    threads for the check (None: its own choice; onnxruntime's calibration session takes none). QuantizationError
    when any of it fails; ``out`` is then untouched.
    """
    if form not in FORMS:
        raise QuantizationError(f"--int8-form {form!r} is unknown; choose {' or '.join(FORMS)}")
    where = str(fp32_path)
    meta = read_metadata(fp32_path)
    shape = _input_shape(meta, where)
    if meta.get("precision", "fp32") != "fp32":
        raise QuantizationError(f"{where} is already {meta['precision']}; quantize the float32 file")
    if task_digest is not None and meta.get("task_digest") not in (None, task_digest):
        raise QuantizationError(
            f"the calibration images are of another task (digest {task_digest[:12]}…) than the model "
            f"({meta['task_digest'][:12]}…); calibrate on data of the federation's task"
        )
    if not 0 <= tolerance <= 1:
        raise QuantizationError(f"--int8-tolerance {tolerance:g} must be a fraction in [0, 1] (0.01 = 1 point)")
    calibration = _check_images(
        calibration, shape, "int8 calibration images", "give images of the model's task, or use --precision fp32"
    )
    check_images = _check_images(check_images, shape, "held-out images", "give labelled images of the model's task")
    check_labels = np.asarray(check_labels).reshape(-1)
    if check_labels.shape[0] != check_images.shape[0]:
        raise QuantizationError(f"{check_images.shape[0]} held-out images but {check_labels.shape[0]} labels")
    if check_images.shape[0] < MIN_CHECK:
        raise QuantizationError(
            f"{check_images.shape[0]} held-out images cannot check an int8 file (at least {MIN_CHECK}); "
            "hold out more labelled images, or use --precision fp32"
        )
    with tempfile.TemporaryDirectory(prefix="feast-int8-") as tmp:
        blob = _quantized_bytes(Path(fp32_path), calibration, Path(tmp), form)
        candidate = Path(tmp) / "checked.onnx"
        candidate.write_bytes(blob)
        try:
            got = predictions(candidate, check_images, threads)
        except Exception as exc:  # noqa: BLE001 - a file onnxruntime cannot load or run
            raise QuantizationError(
                f"onnxruntime cannot run the int8 file ({type(exc).__name__}: {exc}); serve the float32 model"
            ) from None
    want = predictions(fp32_path, check_images, threads)
    labels = check_labels.astype(np.int64)
    check = Int8Check(
        samples=int(labels.shape[0]),
        fp32_accuracy=float((want == labels).mean()),
        int8_accuracy=float((got == labels).mean()),
        agreement=float((got == want).mean()),
    )
    if check.loss > tolerance:
        raise QuantizationError(
            f"the int8 model loses {100 * check.loss:.2f} points against float32 ({check.describe()}), more than "
            f"the tolerance of {100 * tolerance:g}; calibrate on more or more typical images, raise --int8-tolerance, "
            "or use --precision fp32"
        )
    proto = onnx.load_from_string(blob)
    extra = {
        "precision": "int8",
        "quantization": "onnxruntime static, QDQ, per-channel int8 weights, "
        + ("uint8 activations" if form == "onnxruntime" else "symmetric int8 activations (TensorRT)")
        + ", MinMax",
        "int8_form": form,
        "int8_calibration_samples": str(calibration.shape[0]),
        "int8_calibration_origin": origin,
        "int8_check_samples": str(check.samples),
        "int8_accuracy": repr(check.int8_accuracy),
        "fp32_accuracy": repr(check.fp32_accuracy),
        "int8_agreement": repr(check.agreement),
    }
    merged = {**{f"feast.{k}": v for k, v in meta.items()}, **{f"feast.{k}": v for k, v in extra.items()}}
    del proto.metadata_props[:]
    for key, value in merged.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    proto.producer_name = "feast-edge"
    atomic_write_bytes(out, proto.SerializeToString())
    return {k[len("feast.") :]: v for k, v in merged.items()}, check
