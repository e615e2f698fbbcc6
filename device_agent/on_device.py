"""Evaluation and calibration where the data lives: what an agent does for a server that holds no data.

* :func:`answer_evaluation`: an ``evaluate`` request (federated validation, method §8): decode the routed
  state, recalibrate each probe's BN on this device's training split, test it on its held-out split,
  answer the counts. No example leaves the device.
* :func:`calibrate_served_variant`: the served variant's weights (``"calibration": "device"`` in the
  manifest): check them against the architecture, recalibrate BN on this device's training split, export
  the ONNX file here (its metadata says where and on how many examples BN was calibrated) and measure it
  on the held-out split; when the manifest asks for int8, quantize it here on this device's training
  images and keep the int8 file only if it stays within the tolerance on the held-out split.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.personal_model import personalize_here
from feast_edge.agent.threads import latency_threads
from feast_edge.errors import FeastError
from feast_edge.evaluate.bn_stats import MIN_EXAMPLES, bn_statistics, encode_statistics
from feast_edge.evaluate.evaluation import correct_count
from feast_edge.evaluate.federated import calibrated_static, calibration_subset, held_out_counts, routed_supernet
from feast_edge.evaluate.onnx_export import export_onnx, measure_latency
from feast_edge.evaluate.quantize import (
    DEFAULT_CALIBRATION,
    DEFAULT_TOLERANCE,
    PRECISIONS,
    QuantizationError,
    quantize_int8,
)
from feast_edge.personalize.select import Choice
from feast_edge.protocol import Calibrate, Evaluate, Evaluated, RoutedRequest
from feast_edge.route.payload import decode
from feast_edge.route.plans import ClientPlan
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet
from feast_edge.util.atomic import atomic_write_bytes, check_writable
from feast_edge.util.text import printable, shortened

log = logging.getLogger(__name__)

MAX_CALIBRATION = 100_000  # training examples a served variant is calibrated on at most, whatever the manifest asks


class OnDeviceError(FeastError):
    """What the server sent cannot be evaluated or calibrated here."""


MAX_REASON_SHOWN = 1000  # characters of the server's served-round reason in the agent's model line


def served_round_words(manifest: dict[str, Any]) -> str:
    """``; the weights of round 8 of 20 (<why>)`` from a server's manifest ('' from servers before the served round)."""
    served = manifest.get("served_round")
    if (
        not isinstance(served, dict)
        or not isinstance(served.get("round"), int)
        or not isinstance(served.get("of"), int)
    ):
        return ""
    reason = served.get("reason")
    span = served.get("average_of")
    if isinstance(span, list) and len(span) == 2 and all(isinstance(r, int) for r in span):
        words = f"; the mean of the weights of rounds {span[0]}-{span[1]} of {served['of']}"
    else:
        words = f"; the weights of round {served['round']} of {served['of']}"
    # The server's reason names both steps of its choice (feast_edge.evaluate.candidates): whole, one line
    return words + (
        f" ({printable(shortened(reason, MAX_REASON_SHOWN), MAX_REASON_SHOWN)})"
        if isinstance(reason, str) and reason
        else ""
    )


def _routed_model(message: RoutedRequest, payload: bytes, preset: Preset) -> tuple[ClientPlan, Supernet]:
    """The plan ``message`` carries and its routed sub-supernet holding ``payload`` (decoded and checked against it)."""
    plan = message.client_plan(preset)
    expected = plan.manifest(preset, preset.classes, message.round, "routed", dtype=message.payload_dtype)
    manifest, routed = decode(payload, preset, expected=expected)
    if manifest.kind != "routed":
        raise OnDeviceError(f"payload kind {manifest.kind!r} is not 'routed'")
    return plan, routed_supernet(preset, plan, routed)


def answer_evaluation(
    message: Evaluate,
    payload: bytes,
    data: LocalClient,
    preset: Preset,
    torch_device: str = "cpu",
    candidates: Sequence[bytes] = (),
) -> Evaluated:
    """The counts answering ``message`` (its routed ``payload`` decoded and checked against the plan it names) and, per
    further candidate it carries (``candidates``: their payloads, in its order), the same probes' counts on the same
    held-out examples."""
    plan, model = _routed_model(message, payload, preset)
    probes = message.probe_archs(plan)

    def counts_of(supernet: Supernet) -> list[tuple[int, int]]:
        return held_out_counts(
            supernet,
            probes,
            data.images,
            data.holdout_images,
            data.holdout_labels,
            message.calibration,
            torch_device,
            train_labels=data.labels,
        )

    counts = counts_of(model)
    del model  # one routed model in memory at a time: the device evaluates up to its memory limit
    others = [counts_of(_routed_model(message, blob, preset)[1]) for blob in candidates]
    calibrated = min(message.calibration, data.samples) if data.holdout else 0
    return Evaluated.of(message, counts, calibrated, others)


def answer_calibration(
    message: Calibrate, payload: bytes, data: LocalClient, preset: Preset, torch_device: str = "cpu"
) -> tuple[bytes, int]:
    """The BN statistics of the served variants ``message`` names (its routed ``payload`` decoded and checked against
    its plan), on a seeded sample of this device's training split; (safetensors blob, examples used)."""
    plan, supernet = _routed_model(message, payload, preset)
    archs = message.variant_archs(plan)
    examples = min(message.calibration, data.samples, MAX_CALIBRATION)
    if examples < MIN_EXAMPLES:
        raise OnDeviceError(f"this device has {data.samples} training examples; BN statistics need {MIN_EXAMPLES}")
    subset = calibration_subset(data.images, examples)  # a seeded random sample: the device's data as it is
    variants = [bn_statistics(extract(supernet, arch), subset, preset, device=torch_device) for arch in archs]
    return encode_statistics(variants, examples), examples


def _variant_state(blob: bytes, model: StaticResNet) -> dict[str, torch.Tensor]:
    """The weights in ``blob`` if they are exactly ``model``'s tensors (names, shapes, float32, finite)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        state = load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise OnDeviceError(f"the variant's weights are not a valid safetensors file ({exc})") from None
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != want:
        raise OnDeviceError("the variant's weights do not match its architecture (tensor names or shapes differ)")
    for name, tensor in state.items():
        floating = tensor.dtype == torch.float32
        if not (floating or (name.endswith("num_batches_tracked") and tensor.dtype == torch.int64)):
            raise OnDeviceError(f"the variant's tensor {name} is {tensor.dtype}, not float32")
        if floating and not bool(torch.isfinite(tensor).all()):
            raise OnDeviceError(f"the variant's tensor {name} holds non-finite values")
    return state


def _asked_precision(manifest: dict[str, Any]) -> tuple[str, int, float]:
    """The precision the manifest asks for, with its int8 calibration size and tolerance, each checked and bounded."""
    precision = manifest.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise OnDeviceError(
            f"the model manifest asks for precision {str(precision)[:16]!r}; known: {', '.join(PRECISIONS)}"
        )
    samples, tolerance = (
        manifest.get("int8_samples", DEFAULT_CALIBRATION),
        manifest.get("int8_tolerance", DEFAULT_TOLERANCE),
    )
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= MAX_CALIBRATION:
        raise OnDeviceError(f"the model manifest's int8_samples must be an integer in [1, {MAX_CALIBRATION}]")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance <= 1:
        raise OnDeviceError("the model manifest's int8_tolerance must be a number in [0, 1]")
    return precision, samples, float(tolerance)


def _quantize_here(
    path: Path, data: LocalClient, preset: Preset, samples: int, tolerance: float, threads: int | None = None
) -> dict[str, Any]:
    """Replace the exported float32 file by its int8 twin, calibrated on this device's training data and checked on its
    held-out split; what the manifest records of it, or why the float32 file stays (logged)."""
    try:
        if data.samples == 0:
            raise QuantizationError("this device has no training images to calibrate int8 on")
        meta, check = quantize_int8(
            path,
            path,
            calibration_subset(data.images, min(samples, data.samples)),
            data.holdout_images,
            data.holdout_labels,
            origin=f"device {data.device_id}'s training data",
            task_digest=preset.task.digest,
            tolerance=tolerance,
            threads=threads,
        )
    except QuantizationError as exc:
        log.warning(
            "the model of %s stays float32 (it may miss a latency target measured at int8): %s", data.device_id, exc
        )
        return {"int8_refused": str(exc)}
    return {
        "int8_accuracy": check.int8_accuracy,
        "int8_fp32_accuracy": check.fp32_accuracy,
        "int8_agreement": check.agreement,
        "int8_calibration_samples": int(meta["int8_calibration_samples"]),
    }


KEEP_MARGIN = 0.15  # held-out accuracy the federated BN statistics may lose to the device's own before it keeps its own


def _check_federated_bn(model: StaticResNet, data: LocalClient, preset: Preset, calibration: int) -> str:
    """Compare ``model`` (BN statistics of the federation, as the server combined them) on this device's held-out split
    with the same weights recalibrated on its own data. If the federation's statistics lose by more than KEEP_MARGIN
    (and twice the figure's standard error), ``model`` takes its own statistics and the reason is returned; else "".

    The server combines the statistics robustly (feast_edge.evaluate.bn_robust), but a variant only one or two devices
    can run has no majority to check them: this is the last line, on data the server never sees.
    """
    if not data.holdout or data.samples < MIN_EXAMPLES:
        return ""
    federated = correct_count(model, data.holdout_images, data.holdout_labels, preset) / data.holdout
    own = copy.deepcopy(model)
    calibrated_static(own, preset, data.images, calibration, labels=data.labels)
    mine = correct_count(own, data.holdout_images, data.holdout_labels, preset) / data.holdout
    error = math.sqrt(max(mine * (1 - mine), 1 / data.holdout) / data.holdout)
    if mine - federated <= max(KEEP_MARGIN, 2 * error):
        return ""
    model.load_state_dict(own.state_dict())
    reason = (
        f"the federation's BN statistics gave {100 * federated:.1f}% on its {data.holdout} held-out examples, its own "
        f"recalibration {100 * mine:.1f}%: kept its own"
    )
    log.warning("the model of %s: %s", data.device_id, reason)
    return reason


@dataclass(frozen=True)
class ServedModel:
    """The served variant as this device runs it: its weights checked, its BN statistics the federation's or its own."""

    model: StaticResNet
    arch: Arch
    where: str  # "federated" or "device": whose BN statistics it holds
    seen: int  # examples its BN statistics were computed on
    refused: str  # why the federation's statistics were refused ("" when they were not)
    digest: str  # SHA-256 of the received weights


def served_model(blob: bytes, manifest: dict[str, Any], data: LocalClient, preset: Preset) -> ServedModel:
    """The served variant's weights checked against the manifest and the architecture, BN calibrated as it asks."""
    digest = hashlib.sha256(blob).hexdigest()
    if digest != manifest.get("sha256"):
        raise OnDeviceError(f"the received weights hash to {digest}, their manifest says {manifest.get('sha256')}")
    if "preset_digest" in manifest and manifest["preset_digest"] != preset.digest:
        named = str(manifest.get("preset"))[:64]
        raise OnDeviceError(
            f"the model is a variant of preset {named!r}, this device loaded preset {preset.name!r} "
            f"({preset.digest[:12]}); pass --preset with the server's preset ({named})"
        )
    try:
        arch = Arch.from_dict(manifest["arch"]).validated(preset)
    except (KeyError, TypeError, ValueError) as exc:
        raise OnDeviceError(f"the model manifest names no valid architecture of preset {preset.name} ({exc})") from None
    if data.samples == 0 and manifest.get("calibration") != "federated":
        raise OnDeviceError("this device has no training examples to calibrate BN on")
    model = StaticResNet(arch_layout(preset, arch))
    model.load_state_dict(_variant_state(blob, model))
    asked = manifest.get("calibration_samples", 500)
    calibration = int(asked) if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1 else 500
    where = "federated" if manifest.get("calibration") == "federated" else "device"
    refused = ""
    if where == "federated":  # BN already holds the statistics of the devices' data, combined by the server
        seen = calibration
        refused = _check_federated_bn(model, data, preset, min(calibration, MAX_CALIBRATION))
        if refused:
            where, seen = "device", min(calibration, MAX_CALIBRATION, data.samples)
    else:
        seen = calibrated_static(model, preset, data.images, min(calibration, MAX_CALIBRATION), labels=data.labels)
    return ServedModel(model, arch, where, seen, refused, digest)


def calibrate_served_variant(
    blob: bytes,
    manifest: dict[str, Any],
    data: LocalClient,
    preset: Preset,
    path: str | os.PathLike[str],
    *,
    personalize: Choice | None = None,
    torch_device: str = "cpu",
    threads: int = 0,
) -> tuple[Path, dict[str, Any]]:
    """Calibrate, export and measure the served variant; the ONNX file's path and the metrics to report.

    ``personalize``: also write the device's personal model beside it (``feast_edge.agent.personal_model``); None: do not.
    ``threads``: --threads, the onnxruntime threads its latency is timed on (``threads.latency_threads``).
    """
    precision, samples, tolerance = _asked_precision(manifest)
    # The steps below take tens of seconds on a small device: say what the agent does before it goes quiet.
    macs = manifest.get("macs")
    log.info(
        "%s: preparing the served model%s: %s, exporting it to ONNX%s, testing and timing it",
        data.device_id,
        f" ({macs:,} MACs)" if isinstance(macs, int) and not isinstance(macs, bool) else "",
        "checking the federation's BN statistics on its data"
        if manifest.get("calibration") == "federated"
        else "calibrating its BN statistics on its data",
        " and int8" if precision == "int8" else "",
    )
    served = served_model(blob, manifest, data, preset)
    model, arch, where, seen, refused, digest = (
        served.model,
        served.arch,
        served.where,
        served.seen,
        served.refused,
        served.digest,
    )
    correct = correct_count(model, data.holdout_images, data.holdout_labels, preset) if data.holdout else 0
    accuracy = correct / data.holdout if data.holdout else math.nan
    path = check_writable(path, "model file")
    meta = export_onnx(
        model,
        path,
        preset,
        arch,
        class_names=preset.task.classes,
        extra={
            "bn_recalibrated": True,
            "bn_calibration": where,
            "bn_calibration_samples": seen,
            "holdout_accuracy": None if math.isnan(accuracy) else accuracy,
            "holdout_samples": data.holdout,
            "federation": str(manifest.get("federation", "")),
            "rounds": manifest.get("rounds", 0),
            "device": data.device_id,
        },
    )
    int8 = (
        _quantize_here(path, data, preset, samples, tolerance, threads or torch.get_num_threads())
        if precision == "int8"
        else {}
    )
    onnx_bytes = path.read_bytes()
    local = {
        **{k: v for k, v in manifest.items() if k not in ("file", "size", "sha256")},
        "file": path.name,
        "size": len(onnx_bytes),
        "sha256": hashlib.sha256(onnx_bytes).hexdigest(),
        "weights_sha256": digest,
        "bn_recalibrated": True,
        "bn_calibration": where,
        "calibration_samples": seen,
        "holdout_accuracy": None if math.isnan(accuracy) else accuracy,
        "holdout_samples": data.holdout,
        "macs": int(meta["feast.macs"]),
        "precision": "int8" if "int8_accuracy" in int8 else "fp32",
        **int8,
    }
    atomic_write_bytes(path.with_suffix(".json"), (json.dumps(local, indent=1) + "\n").encode())
    latency = measure_latency(path, threads=latency_threads(threads))
    metrics: dict[str, Any] = {
        "calibrated_on": seen,
        "holdout_samples": data.holdout,
        "onnx_latency_ms": latency["median_ms"],
        "model_sha256": local["sha256"],
        "model_macs": local["macs"],
        "model_round": manifest.get("rounds", 0),
        "holdout_accuracy": None if math.isnan(accuracy) else accuracy,  # None: no held-out split here
        "model_precision": local["precision"],
        **({"bn_refused": refused} if refused else {}),
        **{k: v for k, v in int8.items() if k in ("int8_accuracy", "int8_refused")},
    }
    log.info(
        "exported the model of %s (BN %s) to %s (%s MACs, %s): held-out accuracy %s on %d examples, "
        "onnxruntime latency %.3f ms%s",
        data.device_id,
        f"calibrated on {seen} of its examples" if where == "device" else f"of the federation's data, {seen} examples",
        path,
        f"{local['macs']:,}",
        local["precision"],
        "-" if math.isnan(accuracy) else f"{100 * accuracy:.2f}%",
        data.holdout,
        latency["median_ms"],
        served_round_words(manifest),
    )
    if personalize is not None:
        metrics.update(
            personalize_here(
                model,
                arch,
                data,
                preset,
                personalize,
                path,
                local,
                lambda personal: _quantize_here(
                    personal, data, preset, samples, tolerance, threads or torch.get_num_threads()
                ),
                torch_device,
            )
        )
    return path, metrics
