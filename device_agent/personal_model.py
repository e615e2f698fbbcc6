"""The device's personal model, beside the served one: ``{device}.personal.onnx`` and its ``.json`` manifest.

After the served variant is calibrated and exported (``on_device.calibrate_served_variant``), the agent runs the
personalization step of ``feast_edge.personalize.select`` on its own training split, exports the chosen model with
the served one's architecture (int8 where the served file is int8) and measures both on its held-out split. The
served file is never touched; the counts, method and strength, and the classes it was tuned to (``personal_classes``:
its training split's, which its held-out split shares) are what the server learns of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from feast_edge.agent.local_data import LocalClient
from feast_edge.evaluate.onnx_export import export_onnx
from feast_edge.personalize.select import Choice, OwnAccuracy, Personalized, personal_step
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet
from feast_edge.util.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

PERSONAL_FORMAT = "feast-edge/personal-model"


def personal_path(served: Path) -> Path:
    """Where the personal model of the served file ``served`` is written: ``{device}.personal.onnx`` beside it."""
    return served.with_name(f"{served.stem}.personal.onnx")


def personalize_here(
    model: StaticResNet,
    arch: Arch,
    data: LocalClient,
    preset: Preset,
    choice: Choice,
    served: Path,
    served_manifest: dict[str, Any],
    quantize: Any,
    torch_device: str = "cpu",
) -> dict[str, Any]:
    """Personalize the served ``model`` on ``data`` and write it beside ``served``; the metrics to report.

    ``quantize(path)``: turns the exported float32 file into int8 in place (the served file's own check), returning
    what the manifest records; called only when the served file is int8. A stale personal file of an earlier export is
    removed when this one keeps none, so the two files on the device always belong to the same served model.
    """
    began = time.perf_counter()
    if choice.method != "off":
        log.info("%s: personalizing the served model on its data (--personalize %s)", data.device_id, choice)
    outcome, own = personal_step(
        model,
        data.images,
        data.labels,
        data.holdout_images,
        data.holdout_labels,
        preset,
        choice,
        device=torch_device,
    )
    path = personal_path(served)
    seconds = time.perf_counter() - began
    if outcome.model is None:
        for stale in (path, path.with_suffix(".json")):
            stale.unlink(missing_ok=True)
        log.info("%s keeps the served model alone: %s", data.device_id, outcome.reason)
        return _metrics(outcome, own, seconds, None)
    words = _accuracy_words(own)
    meta = {**outcome.metadata(), **_own(own), "device": data.device_id, "served_sha256": served_manifest["sha256"]}
    export_onnx(outcome.model, path, preset, arch, class_names=preset.task.classes, extra=meta)
    int8 = quantize(path) if served_manifest.get("precision") == "int8" else {}
    blob = path.read_bytes()
    manifest = {
        "format": PERSONAL_FORMAT,
        "version": 1,
        **meta,
        "served_file": served.name,
        "arch": arch.to_dict(),
        "macs": served_manifest["macs"],
        "file": path.name,
        "size": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "precision": "int8" if "int8_accuracy" in int8 else "fp32",
        **int8,
    }
    atomic_write_bytes(path.with_suffix(".json"), (json.dumps(manifest, indent=1) + "\n").encode())
    tuned = "" if outcome.tuned is None else outcome.tuned.words()
    log.info(
        "%s: personal model written to %s: %s; held-out accuracy %s%s",
        data.device_id,
        path,
        outcome.reason,
        words,
        f"; {tuned}" if tuned else "",
    )
    return _metrics(outcome, own, seconds, manifest)


def _own(own: OwnAccuracy) -> dict[str, Any]:
    return {
        "holdout_samples": own.examples,
        "holdout_accuracy_served": own.served_accuracy,
        "holdout_accuracy_personal": own.personal_accuracy,
    }


def _accuracy_words(own: OwnAccuracy) -> str:
    if not own.examples:
        return "not measured (no held-out split)"
    return f"{100 * own.served / own.examples:.2f}% served -> {100 * own.personal / own.examples:.2f}% personal ({own.examples} examples)"


def _metrics(
    outcome: Personalized, own: OwnAccuracy, seconds: float, manifest: dict[str, Any] | None
) -> dict[str, Any]:
    """What the server learns of the personal model: counts and choices only, never an example."""
    return {
        "personal_method": outcome.method,
        "personal_strength": outcome.strength,
        "personal_reason": outcome.reason[:300],
        "personal_accuracy": own.personal_accuracy,
        "personal_seconds": round(seconds, 3),
        **(
            {}
            if manifest is None
            else {"personal_sha256": manifest["sha256"], "personal_precision": manifest["precision"]}
        ),
        # The classes it was tuned to (names and the task's count), so the server can say what it forgot.
        **({} if manifest is None or outcome.tuned is None else outcome.tuned.to_metrics()),
    }
