"""A simulated population written to disk: one data shard per client, plus the server-held splits (method §4).

``write_partition(config, out)`` runs the simulator's own ``build_setup`` and
writes, for every client, a safetensors file with its uint8 images and int64
labels (exactly the tensors ``Setup.client_data`` gives the simulator, in the
same order) and a JSON header naming the client id, its budget and the
preset; ``server.safetensors`` holds the server's validation and
BN-calibration splits; ``index.json`` lists everything with SHA-256 digests.
Device agents train on these files, so a federation over MQTT sees exactly the
data of the simulation with the same config. Nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_save

from feast_edge.errors import FeastError
from feast_edge.settings import flat
from feast_edge.util.atomic import atomic_write_bytes

if TYPE_CHECKING:  # writing a partition needs the harness set-up; reading a shard (what an agent does) does not
    from feast_edge.sim.setup import Setup, SimulationConfig

SHARD_FORMAT = "feast-edge/shard"
SERVER_FORMAT = "feast-edge/server-split"
INDEX_FORMAT = "feast-edge/partition"
VERSION = 1
META_KEY = "feast_edge"
INDEX = "index.json"
SERVER_FILE = "server.safetensors"


class ShardError(FeastError, ValueError):
    """A shard file or partition directory is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Shard:
    """One client's local data: uint8 images ``[N, C, H, W]``, int64 labels ``[N]``, and what the partition says about it."""

    client_id: str
    images: torch.Tensor
    labels: torch.Tensor
    budget_macs: float
    preset: str
    preset_digest: str
    classes: int
    path: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class ServerSplit:
    """The server-held data of a partition: validation images/labels and BN-calibration images (method §4, §8)."""

    validation_images: torch.Tensor
    validation_labels: torch.Tensor
    calibration_images: torch.Tensor


def _write(path: Path, tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> str:
    blob = safetensors_save(
        {k: v.contiguous() for k, v in tensors.items()}, metadata={META_KEY: json.dumps(record, sort_keys=True)}
    )
    atomic_write_bytes(path, blob)
    return hashlib.sha256(blob).hexdigest()


def write_partition(
    config: SimulationConfig, out: str | os.PathLike[str], setup: Setup | None = None
) -> dict[str, Any]:
    """Write every client's shard, the server split and ``index.json`` into ``out``; returns the index."""
    from feast_edge.sim.setup import build_setup

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    setup = build_setup(config) if setup is None else setup
    preset = setup.preset
    common = {
        "preset": preset.name,
        "preset_digest": preset.digest,
        "classes": preset.classes,
        "dataset": config.dataset,
        "fingerprint": config.fingerprint(),
    }
    clients = []
    for cid, budget in zip(setup.client_ids, setup.population.budgets):
        images, labels = setup.client_data(cid)
        record = {
            "format": SHARD_FORMAT,
            "version": VERSION,
            "client_id": cid,
            "budget_macs": float(budget),
            "samples": int(labels.shape[0]),
            **common,
        }
        name = f"{cid}.safetensors"
        sha = _write(out / name, {"images": images, "labels": labels}, record)
        clients.append(
            {
                "client_id": cid,
                "file": name,
                "budget_macs": float(budget),
                "samples": int(labels.shape[0]),
                "sha256": sha,
            }
        )
    val = torch.tensor(np.asarray(setup.validation), dtype=torch.long)
    calib = torch.tensor(np.asarray(setup.calibration), dtype=torch.long)
    server_record = {
        "format": SERVER_FORMAT,
        "version": VERSION,
        "validation": len(val),
        "calibration": len(calib),
        **common,
    }
    server_sha = _write(
        out / SERVER_FILE,
        {
            "validation_images": setup.train_set.images[val],
            "validation_labels": setup.train_set.labels[val],
            "calibration_images": setup.train_set.images[calib],
        },
        server_record,
    )
    index = {
        "format": INDEX_FORMAT,
        "version": VERSION,
        **common,
        "config": flat(config),
        "clients": clients,
        "server": {"file": SERVER_FILE, "validation": len(val), "calibration": len(calib), "sha256": server_sha},
    }
    atomic_write_bytes(out / INDEX, (json.dumps(index, indent=1) + "\n").encode())
    return index


def is_partition(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory written by :func:`write_partition`."""
    return (Path(path) / INDEX).is_file()


def read_index(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The validated ``index.json`` of a partition directory."""
    path = Path(directory) / INDEX
    if not path.is_file():
        raise ShardError(
            f"{directory} is not a partition directory (no {INDEX}); write one with 'feast-edge partition --out DIR'"
        )
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardError(
            f"{path} is not valid JSON ({exc}); rewrite the partition with 'feast-edge partition'"
        ) from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or index.get("version") != VERSION:
        raise ShardError(
            f"{path} is not a feast-edge partition index (format {INDEX_FORMAT!r}, version {VERSION}); rewrite it with 'feast-edge partition'"
        )
    clients = index.get("clients")
    if not isinstance(clients, list) or not all(
        isinstance(c, dict) and {"client_id", "file"} <= set(c) for c in clients
    ):
        raise ShardError(f"{path} has a malformed client list; rewrite the partition with 'feast-edge partition'")
    return index


def _open(path: Path, what: str, fmt: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not path.is_file():
        raise ShardError(f"{what} {path} does not exist; pass a file written by 'feast-edge partition'")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ShardError(
            f"{path} is not a safetensors {what} ({exc}); pass a file written by 'feast-edge partition'"
        ) from None
    try:
        record = json.loads(meta[META_KEY])
    except (KeyError, json.JSONDecodeError):
        raise ShardError(f"{path} is a safetensors file but not a feast-edge {what} (no '{META_KEY}' header)") from None
    if not isinstance(record, dict) or record.get("format") != fmt or record.get("version") != VERSION:
        raise ShardError(
            f"{path} is not a {what} (format {fmt!r} version {VERSION}); pass a file written by 'feast-edge partition'"
        )
    return record, tensors


def _check_images(
    path: Path, images: torch.Tensor | None, labels: torch.Tensor | None, classes: int, prefix: str = ""
) -> None:
    if images is None or images.dtype != torch.uint8 or images.dim() != 4:
        raise ShardError(f"{path}: tensor '{prefix}images' must be uint8 [N, C, H, W]")
    if labels is None:
        return
    if labels.dtype != torch.int64 or labels.shape != (images.shape[0],):
        raise ShardError(f"{path}: tensor '{prefix}labels' must be int64 [N] with one label per image")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ShardError(f"{path}: labels must lie in [0, {classes}); the file is corrupt")


def read_shard(path: str | os.PathLike[str]) -> Shard:
    """Load and validate one client's shard file."""
    path = Path(path)
    record, tensors = _open(path, "shard file", SHARD_FORMAT)
    try:
        client_id, budget = str(record["client_id"]), float(record["budget_macs"])
        preset, digest, classes = str(record["preset"]), str(record["preset_digest"]), int(record["classes"])
    except (KeyError, TypeError, ValueError):
        raise ShardError(
            f"{path}: the shard header is incomplete; rewrite the partition with 'feast-edge partition'"
        ) from None
    images, labels = tensors.get("images"), tensors.get("labels")
    _check_images(path, images, labels, classes)
    if images.shape[0] == 0:  # type: ignore[union-attr]
        raise ShardError(f"{path} holds no examples; a client needs at least one")
    return Shard(client_id, images, labels, budget, preset, digest, classes, str(path))  # type: ignore[arg-type]


def read_server_split(directory: str | os.PathLike[str]) -> ServerSplit:
    """The validation and calibration splits a partition holds out for the server."""
    index = read_index(directory)
    path = Path(directory) / str(index.get("server", {}).get("file", SERVER_FILE))
    record, tensors = _open(path, "server split", SERVER_FORMAT)
    classes = int(record.get("classes", 0))
    _check_images(path, tensors.get("validation_images"), tensors.get("validation_labels"), classes, "validation_")
    _check_images(path, tensors.get("calibration_images"), None, classes, "calibration_")
    return ServerSplit(tensors["validation_images"], tensors["validation_labels"], tensors["calibration_images"])
