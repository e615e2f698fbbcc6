"""One model per registered device: its largest affordable cached variant (unless a smaller affordable one is better
on the federation's validation: ``feast_edge.evaluate.coverage``), BN-recalibrated (method §8).

With server-held data, each distinct variant is extracted, recalibrated on the
server's calibration split, validated and exported once; every device it serves
gets its own copy ``models/{device}.onnx`` and a manifest ``models/{device}.json``
with the device, arch, MACs, params, validation accuracy and the file's SHA-256.

Without server data (:func:`export_device_variants`), each device gets
``models/{device}.variant.safetensors``, the extracted variant's weights: with
the federated BN statistics of the devices that can run it in its BN buffers
(``"calibration": "federated"``, ``bn_calibration.FederatedCalibration``), or
for the device to recalibrate on its own training split (``"calibration":
"device"``). The device exports the ONNX file itself and reports its accuracy on
its held-out split (``feast_edge.agent.model_files``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from feast_edge.cache.variants import VariantCache
from feast_edge.errors import FeastError
from feast_edge.evaluate.bn_stats import apply_statistics
from feast_edge.evaluate.coverage import Serving
from feast_edge.evaluate.evaluation import accuracy, calibrated_variant
from feast_edge.evaluate.onnx_export import export_onnx
from feast_edge.evaluate.quantize import DEFAULT_CALIBRATION, DEFAULT_TOLERANCE, QuantizationError, quantize_int8
from feast_edge.server.bn_calibration import Calibrated
from feast_edge.server.coverage import manifest_coverage, serving_plan
from feast_edge.server.held_data import ServerData
from feast_edge.server.registry import Device
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract
from feast_edge.space.supernet import Supernet
from feast_edge.util.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

MODELS = "models"
MANIFEST_FORMAT = "feast-edge/device-model"


class ExportError(FeastError):
    """A device model cannot be exported or served."""


@dataclass(frozen=True)
class Int8Settings:
    """How served files are quantized: ``precision`` "auto" (each device's registered one), "fp32" or "int8"."""

    precision: str = "auto"
    samples: int = DEFAULT_CALIBRATION
    tolerance: float = DEFAULT_TOLERANCE

    def for_device(self, device: Device) -> str:
        """The precision ``device`` is served in."""
        return device.precision if self.precision == "auto" else self.precision


def _validated_variant(supernet: Supernet, arch: Arch, data: ServerData) -> tuple[torch.nn.Module, float]:
    """One variant calibrated on the server's data, and its validation accuracy in float32."""
    model = calibrated_variant(supernet, arch, data.calibration_images).cpu()
    return model, accuracy(model, data.validation_images, data.validation_labels, supernet.preset)


def _served_variant(
    supernet: Supernet,
    arch: Arch,
    validated: tuple[torch.nn.Module, float],
    data: ServerData,
    directory: Path,
    extra: dict[str, Any],
    precision: str,
    int8: Int8Settings,
) -> tuple[bytes, dict[str, str], float, str]:
    """One calibrated variant exported (and quantized when ``precision`` is int8): the file's bytes, its metadata, its
    validation accuracy in float32, and why int8 was refused ("" when it was not)."""
    model, acc = validated
    tmp = directory / f".variant-{arch.slug}-{precision}.onnx"
    try:
        meta = export_onnx(
            model, tmp, supernet.preset, arch, class_names=data.class_names, extra={**extra, "validation_accuracy": acc}
        )
        refused = ""
        if precision == "int8":
            try:
                meta, _ = quantize_int8(
                    tmp,
                    tmp,
                    data.calibration_images[: int8.samples],
                    data.validation_images,
                    data.validation_labels,
                    origin=f"the server's calibration split ({data.source})",
                    task_digest=supernet.preset.task.digest,
                    tolerance=int8.tolerance,
                )
                meta = {f"feast.{k}": v for k, v in meta.items()}
            except QuantizationError as exc:
                refused = str(exc)
                log.warning("serving %s in float32 (it may miss a latency target measured at int8): %s", arch, exc)
        return tmp.read_bytes(), meta, acc, refused
    finally:
        tmp.unlink(missing_ok=True)


def export_device_models(
    supernet: Supernet,
    cache: VariantCache,
    devices: Sequence[Device],
    data: ServerData,
    out: str | os.PathLike[str],
    *,
    federation: str,
    rounds_done: int,
    checkpoint: str,
    progress: Callable[[str], None] | None = None,
    int8: Int8Settings = Int8Settings(),
    rule: str = "validated",
    served: Mapping[str, Any] | None = None,
    model_version: int | None = None,
    version_report: str = "figures",
    trained: Collection[int] | None = None,
) -> list[dict[str, Any]]:
    """Export every device's model into ``out/models``; returns the manifests (sorted by device id).

    The serving rule compares, on the server's validation split, every variant the largest-affordable rule serves
    some device: a device gets a smaller one of those it can afford when it is better (feast_edge.evaluate.coverage).
    ``trained`` (--secure-agg): the variants whose every slice a release moved, the only ones served.
    """
    directory = Path(out) / MODELS
    directory.mkdir(parents=True, exist_ok=True)
    preset = supernet.preset
    variants: dict[tuple[Arch, str], tuple[bytes, dict[str, str], float, str]] = {}
    manifests = []
    extra = {"bn_recalibrated": True, "federation": federation, "rounds": rounds_done}
    candidates = sorted({cache.entries.index(cache.largest_servable(d.budget_macs, trained)) for d in devices})
    validated = {i: _validated_variant(supernet, cache.entries[i].arch, data) for i in candidates}
    held = int(data.validation_labels.shape[0])
    points = {i: acc for i, (_, acc) in validated.items()}
    serving = serving_plan(cache, devices, points, dict.fromkeys(points, held), rule, trained)
    for device in sorted(devices, key=lambda d: d.device_id):
        chosen = serving[device.device_id]
        entry = cache.entries[chosen.index]
        precision = int8.for_device(device)
        if (entry.arch, precision) not in variants:
            start = time.perf_counter()
            variants[entry.arch, precision] = _served_variant(
                supernet, entry.arch, validated[chosen.index], data, directory, extra, precision, int8
            )
            blob, meta, acc, _ = variants[entry.arch, precision]
            message = (
                f"exported {entry.arch} ({entry.macs / 1e6:.2f}M MACs, {meta['feast.precision']}): validation "
                f"accuracy {100 * acc:.2f}%"
                + (f", int8 {100 * float(meta['feast.int8_accuracy']):.2f}%" if "feast.int8_accuracy" in meta else "")
                + f" in {time.perf_counter() - start:.1f} s"
            )
            log.info(message)
            if progress is not None:
                progress(message)
        blob, meta, acc, refused = variants[entry.arch, precision]
        path = directory / f"{device.device_id}.onnx"
        atomic_write_bytes(path, blob)
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "device": device.device_id,
            "federation": federation,
            "preset": preset.name,
            "preset_digest": preset.digest,
            "budget_macs": device.budget_macs,
            "arch": entry.arch.to_dict(),
            "macs": int(meta["feast.macs"]),
            "params": int(meta["feast.params"]),
            "validation_accuracy": acc,
            "validation_samples": int(data.validation_labels.shape[0]),
            **_serving_fields(chosen),
            # The server's validation split holds every class it was given; training covered the trainers' classes.
            "coverage": manifest_coverage(devices, entry.macs, preset.task.classes),
            "precision": meta["feast.precision"],
            **_int8_fields(meta, precision, refused),
            "bn_recalibrated": True,
            "rounds": rounds_done,
            # The served weights' round of the run's rounds, and the rule's reason (feast_edge.evaluate.served_round).
            "served_round": dict(served or {"round": rounds_done}),
            # The served version this file is of (server.versions): the device compares it with the one it runs and
            # reports its decision with the paired counts ("figures"), or under DP its decision alone ("decision").
            **({"model_version": model_version, "version_report": version_report} if model_version else {}),
            "checkpoint": checkpoint,
            "file": path.name,
            "size": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
        atomic_write_bytes(directory / f"{device.device_id}.json", (json.dumps(manifest, indent=1) + "\n").encode())
        manifests.append(manifest)
    atomic_write_bytes(directory / "index.json", (json.dumps({"models": manifests}, indent=1) + "\n").encode())
    return manifests


def _serving_fields(chosen: Serving) -> dict[str, Any]:
    """The manifest's record of the serving rule that chose the variant."""
    return {
        "serving_rule": chosen.rule,
        "largest_affordable_macs": chosen.largest_macs,
        **({} if chosen.accuracy is None else {"serving_validation": chosen.accuracy}),
    }


def _int8_fields(meta: dict[str, str], asked: str, refused: str) -> dict[str, Any]:
    """The manifest's record of the int8 file (its accuracy against float32), or of why float32 is served instead."""
    if meta.get("feast.precision") == "int8":
        return {
            "int8_accuracy": float(meta["feast.int8_accuracy"]),
            "int8_agreement": float(meta["feast.int8_agreement"]),
            "int8_calibration_samples": int(meta["feast.int8_calibration_samples"]),
        }
    return {"int8_refused": refused} if asked == "int8" and refused else {}


VARIANT_FORMAT = "feast-edge/variant-weights"


def export_device_variants(
    supernet: Supernet,
    cache: VariantCache,
    devices: Sequence[Device],
    out: str | os.PathLike[str],
    *,
    federation: str,
    rounds_done: int,
    checkpoint: str,
    calibration: int,
    statistics: Mapping[Arch, Calibrated] | None = None,
    int8: Int8Settings = Int8Settings(),
    serving: Mapping[str, Serving] | None = None,
    served: Mapping[str, Any] | None = None,
    model_version: int | None = None,
    version_report: str = "figures",
) -> list[dict[str, Any]]:
    """Every device's served variant as weights for the device to export (in the precision ``int8`` gives it); returns
    the manifests. ``serving``: each device's variant by the serving rule (None: its largest affordable).

    A variant with federated ``statistics`` carries them in its BN buffers (``"calibration": "federated"``); the
    others are recalibrated by each device on its own data (``"calibration": "device"``).
    """
    from safetensors.torch import save

    directory = Path(out) / MODELS
    directory.mkdir(parents=True, exist_ok=True)
    preset, statistics = supernet.preset, statistics or {}
    blobs: dict[Arch, bytes] = {}
    manifests = []
    serving = serving or serving_plan(cache, devices, {})
    for device in sorted(devices, key=lambda d: d.device_id):
        chosen = serving[device.device_id]
        entry = cache.entries[chosen.index]
        federated = statistics.get(entry.arch)
        if entry.arch not in blobs:
            model = extract(supernet, entry.arch)
            if federated is not None:
                apply_statistics(model, federated.stats)
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            blobs[entry.arch] = save(state, metadata={"format": VARIANT_FORMAT, "arch": entry.arch.to_json()})
        blob = blobs[entry.arch]
        path = directory / f"{device.device_id}.variant.safetensors"
        atomic_write_bytes(path, blob)
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "device": device.device_id,
            "federation": federation,
            "preset": preset.name,
            "preset_digest": preset.digest,
            "task_digest": preset.task.digest,
            "budget_macs": device.budget_macs,
            "arch": entry.arch.to_dict(),
            "macs": int(entry.macs),
            "params": int(entry.params),
            # federated: BN holds the devices' combined statistics; device: the device recalibrates BN on its own data.
            # Either way the device exports the ONNX file and reports its held-out accuracy.
            "calibration": "device" if federated is None else "federated",
            "calibration_samples": calibration if federated is None else federated.examples,
            **({} if federated is None else {"calibration_devices": list(federated.devices)}),
            **_serving_fields(chosen),
            "coverage": manifest_coverage(
                devices, entry.macs, preset.task.classes, None if federated is None else federated.devices
            ),
            "bn_recalibrated": federated is not None,
            # The device exports float32, or quantizes on its own training data and checks on its held-out split.
            "precision": int8.for_device(device),
            **(
                {"int8_samples": int8.samples, "int8_tolerance": int8.tolerance}
                if int8.for_device(device) == "int8"
                else {}
            ),
            "rounds": rounds_done,
            # The served weights' round of the run's rounds, and the rule's reason (feast_edge.evaluate.served_round).
            "served_round": dict(served or {"round": rounds_done}),
            # The served version this file is of (server.versions): the device compares it with the one it runs and
            # reports its decision with the paired counts ("figures"), or under DP its decision alone ("decision").
            **({"model_version": model_version, "version_report": version_report} if model_version else {}),
            "checkpoint": checkpoint,
            "file": path.name,
            "size": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
        atomic_write_bytes(directory / f"{device.device_id}.json", (json.dumps(manifest, indent=1) + "\n").encode())
        manifests.append(manifest)
    log.info("%d device model(s) ready for calibration on their devices in %s", len(manifests), directory)
    atomic_write_bytes(directory / "index.json", (json.dumps({"models": manifests}, indent=1) + "\n").encode())
    return manifests


def read_device_model(out: str | os.PathLike[str], device_id: str) -> tuple[bytes, dict[str, Any]] | None:
    """The exported ONNX bytes and manifest of a device, or None if none was exported; ExportError if they disagree."""
    directory = Path(out) / MODELS
    manifest_path = directory / f"{device_id}.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        blob = (directory / manifest["file"]).read_bytes()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(
            f"the exported model of {device_id} in {directory} is unreadable ({exc}); run 'feast-server export' again"
        ) from None
    if hashlib.sha256(blob).hexdigest() != manifest.get("sha256"):
        raise ExportError(
            f"{directory / manifest['file']} does not match the SHA-256 in its manifest; run 'feast-server export' again"
        )
    return blob, manifest
