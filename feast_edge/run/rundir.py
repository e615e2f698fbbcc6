"""What a ``feast-server run`` directory says for people: its registry, its exported models, where validation and BN calibration ran.

The dashboard (``feast-edge dashboard RUN_DIR``), the report (``feast-edge report RUN_DIR``) and ``feast-server
status`` read a run directory here and describe it in the same words:

* validation ran on the server's ``--data`` (the paper's protocol), or was *federated*: the cohort tested the probe
  variants on its held-out splits (``RoundRecord.validation`` says on which devices and how many examples);
* a device's model was BN-calibrated on the server's data (its manifest has a ``validation_accuracy``), or on the device
  itself (``"calibration": "device"``): then the accuracy is the one the device reported on its own held-out split
  (the registry's ``metrics`` of that device, for the exported round).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError

REGISTRY = "devices.sqlite"  # feast-server's device registry (the apps' constant; core does not import them)
MODELS = "models"
SERVER, DEVICES = "server", "devices"  # where validation ran
DEVICE = "device"  # a manifest's "calibration" when its device calibrates BN on its own data
FEDERATED = "federated"  # ... when BN holds the statistics of the devices' data, combined by the server
FEDERATION = "federation"  # the checkpoint kind of a feast-server run


class RunDirError(FeastError):
    """A run directory's registry or model index cannot be read."""


def read_registry(path: Path, fields: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The registered devices (profile and metrics parsed): ``devices.sqlite`` read-only when present, else the checkpoint's copy."""
    database = path / REGISTRY
    if not database.is_file():
        return [dict(d) for d in fields.get("registry") or () if isinstance(d, Mapping)]
    try:
        connection = sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
        try:
            connection.row_factory = sqlite3.Row
            rows = connection.execute("SELECT * FROM devices ORDER BY device_id").fetchall()
        finally:
            connection.close()
    except sqlite3.Error as exc:
        raise RunDirError(
            f"cannot read the device registry {database} ({exc}); is it a feast-server run directory?"
        ) from None
    devices = []
    for row in rows:
        device = dict(row)
        for key in ("profile", "metrics"):
            try:
                device[key] = json.loads(device.get(key) or "{}")
            except (TypeError, json.JSONDecodeError):
                device[key] = {}
        devices.append(device)
    return devices


def read_manifests(path: Path) -> list[dict[str, Any]]:
    """The manifests of the exported models (``models/index.json``), if the run exported any."""
    index = path / MODELS / "index.json"
    if not index.is_file():
        return []
    try:
        models = json.loads(index.read_text(encoding="utf-8")).get("models", [])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise RunDirError(f"cannot read {index} ({exc}); run 'feast-server export --out {path}' again") from None
    return [m for m in models if isinstance(m, dict)]


# ------------------------------------------------------------------ validation
def validated_on(val_accuracy: float | None, validation: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Where one round was validated: ``{"source": "devices", "devices": n, "samples": m}`` (federated) or
    ``{"source": "server"}``; None for a round not validated."""
    if val_accuracy is None:
        return None
    validation = validation or {}
    if validation.get("source") == DEVICES:
        devices = validation.get("devices")
        samples = validation.get("samples")
        return {
            "source": DEVICES,
            "devices": len(devices) if isinstance(devices, (list, tuple)) else 0,
            "samples": samples if isinstance(samples, int) else 0,
        }
    return {"source": SERVER}


def run_validated_on(fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where a feast-server run (its checkpoint's fields) validates: as in its last validated round, else by its
    ``data`` (None: federated); None for another kind of run (a simulation validates on its own split)."""
    if fields.get("kind", FEDERATION) != FEDERATION:
        return None
    for record in reversed(list(fields.get("history") or ())):
        where = validated_on(record.get("val_accuracy"), record.get("validation"))
        if where is not None:
            return where
    if "data" not in fields:  # checkpoints from before a server could run without data
        return None
    return {"source": DEVICES if fields["data"] is None else SERVER}


def _devices(n: int) -> str:
    return "1 device's" if n == 1 else f"{n} devices'"


def validation_words(where: Mapping[str, Any] | None) -> str | None:
    """``validation: on the server's data`` or ``validation: federated, on 3 devices' held-out data (60 examples)``."""
    if where is None:
        return None
    if where.get("source") != DEVICES:
        return "validation: on the server's data"
    if "devices" not in where:
        return "validation: federated, on the devices' held-out data"
    return f"validation: federated, on {_devices(where['devices'])} held-out data ({where.get('samples', 0)} examples)"


# ------------------------------------------------------------------ BN calibration of the exported models
def device_calibrated(manifest: Mapping[str, Any]) -> bool:
    """Whether ``manifest``'s model is exported as ONNX on its device (its BN calibrated there, or federated) rather
    than calibrated and exported on the server."""
    return manifest.get("calibration") in (DEVICE, FEDERATED)


def served_precision(manifest: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> str:
    """The precision of the file a device is served: the manifest's (exported on the server) or the one the device
    reported it kept (exported on the device); ``"fp32 (int8 refused)"`` when int8 was asked and refused, ``"int8
    asked"`` while the device has not reported this export."""
    asked = str(manifest.get("precision", "fp32"))
    if device_calibrated(manifest):
        metrics = metrics or {}
        if "model_precision" not in metrics or metrics.get("model_round") != manifest.get("rounds"):
            return f"{asked} asked"
        kept, refused = str(metrics["model_precision"]), metrics.get("int8_refused")
    else:
        kept, refused = asked, manifest.get("int8_refused")
    return f"{kept} (int8 refused)" if refused else kept


def model_accuracy(manifest: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """How one exported model is calibrated and how accurate it is: ``calibration`` (server/device), ``accuracy``,
    ``accuracy_note`` (in words), and for a device-calibrated model what the device reported for the exported round."""
    if not device_calibrated(manifest):
        return {
            "calibration": SERVER,
            "accuracy": manifest.get("validation_accuracy"),
            "accuracy_note": "validation, on the server's data",
        }
    metrics = metrics or {}
    reported = "holdout_accuracy" in metrics and metrics.get("model_round", manifest.get("rounds")) == manifest.get(
        "rounds"
    )  # metrics of an earlier export are not this model's
    where = manifest["calibration"]
    calibrated = "calibrated on the device" if where == DEVICE else "federated BN statistics"
    if not reported:
        return {
            "calibration": where,
            "accuracy": None,
            "accuracy_note": f"{calibrated}; no report from it yet",
        }
    samples = metrics.get("holdout_samples")
    return {
        "calibration": where,
        "accuracy": metrics.get("holdout_accuracy"),
        "accuracy_note": f"{calibrated}; held-out accuracy on its own data"
        + (f" ({samples} examples)" if isinstance(samples, int) else ""),
        "holdout_accuracy": metrics.get("holdout_accuracy"),
        "holdout_samples": samples,
        "calibrated_on": metrics.get("calibrated_on"),
        "model_sha256": metrics.get("model_sha256"),
    }
