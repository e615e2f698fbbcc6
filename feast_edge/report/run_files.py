"""A ``feast-server run`` directory as files: its device registry (``devices.sqlite``, read-only, or the checkpoint's
copy) and the manifests of its exported models (``models/index.json``); the names of where validation and BN
calibration ran. What they say for people is feast_edge.report.model_words."""

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
